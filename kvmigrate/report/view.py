"""The cells every human renderer prints, computed once from a summary.

Text, Markdown and HTML differ only in layout: they all take their tables from here, so
the same summary can never show different numbers in two formats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmigrate.selection import Selection
from kvmigrate.units import human_bytes, human_count, percent, plural

EXIT_BITS = ((1, "findings"), (4, "integrity"), (8, "operational"))


@dataclass
class Table:
    """Headers, string cells, and which columns are numbers (right-aligned)."""

    key: str
    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    numeric: set[int] = field(default_factory=set)
    names: set[int] = field(default_factory=set)  # identifier columns (code spans in Markdown)


def ranks_label(ranks: list[int]) -> str:
    if not ranks:
        return "-"
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)


def gate_label(n: dict[str, Any]) -> str:
    if not n.get("target_base"):
        return "no target"
    gate = n["gate"]
    if gate.get("by_name"):
        return "by name"
    if gate.get("replicated_layout"):
        return "replicated"
    if gate.get("parallel_agnostic"):
        return "agnostic"
    return "specific"


def exit_label(code: int) -> str:
    names = [name for bit, name in EXIT_BITS if code & bit]
    return f"{code} ({' + '.join(names)})" if names else "0 (clean)"


_UNKNOWN_BECAUSE = {"config_invalid": "config.json invalid", "orphan_namespace": "no config.json",
                    "digest_mismatch": "config.json does not match the folder"}


def family_label(n: dict[str, Any]) -> str:
    """The namespace's family, or why it is unknown ('unknown (config.json invalid)'), never 'None'."""
    if n.get("family"):
        return str(n["family"])
    why = _UNKNOWN_BECAUSE.get(n.get("status") or "")
    return f"unknown ({why})" if why else "unknown"


def identity_label(n: dict[str, Any]) -> str:
    """'vllm S2', 'vllmcpp vllmcpp-v1', or 'unknown (config.json invalid)' (one line per namespace)."""
    if not n.get("family"):
        return family_label(n)
    return f"{n['family']} {n['scheme']}" if n.get("scheme") else f"{n['family']} (scheme unknown)"


def or_dash(value: Any) -> str:
    return "-" if value in (None, "") else str(value)


def totals_pairs(s: dict[str, Any]) -> list[tuple[str, str]]:
    t = s["totals"]
    return [
        ("namespaces", str(t["namespaces"])),
        ("files", human_count(t["files"])),
        ("bytes", human_bytes(t["bytes"])),
        ("blocks", human_count(t["blocks"])),
        ("reusable blocks", human_count(t["reusable"]["blocks"])),
        ("reusable bytes", f"{human_bytes(t['reusable']['bytes'])} "
                           f"({percent(t['reusable']['bytes'], t['block_bytes'] - t['replicas']['bytes'])})"),
        ("pending blocks", human_count(t["pending"]["blocks"])),
        ("pending bytes", human_bytes(t["pending"]["bytes"])),
        *merge_pairs(t),
        ("not reusable blocks", human_count(t["not_reusable"]["blocks"])),
        ("not reusable bytes", human_bytes(t["not_reusable"]["bytes"])),
        ("replica copies", f"{plural(t['replicas']['files'], 'file')}, {human_bytes(t['replicas']['bytes'])} "
                           "(other ranks of blocks taken from rank 0)"),
        ("held alone", human_bytes(t["bytes_alone"])),
        ("shared (hard links)", human_bytes(t["bytes_shared"])),
        ("data on disk", f"{human_bytes(t['data_bytes'])} (a hard-linked file counted once)"),
        *transform_pairs(t.get("transform_cost") or {}),
        ("exit code", exit_label(s["exit_code"])),
    ]


def merge_pairs(c: dict[str, Any]) -> list[tuple[str, str]]:
    """The merge duplicates line, when there are any: blocks another source namespace places
    at the same target path (not pending; the dry run's "merge" line)."""
    m = c.get("merge_duplicates") or {}
    if not m.get("blocks"):
        return []
    return [("merge duplicates", f"{plural(m['blocks'], 'block')}, {human_bytes(m['bytes'])} (another source "
                                 "namespace places the same block: not pending, as in migrate's dry run)")]


def transform_pairs(costs: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """One line per pending transform: bytes to write, estimated time, space saved or spent."""
    from kvmigrate.cost import cost_line

    return [("transform cost", cost_line(action, cost, human_bytes)) for action, cost in costs.items()]


def namespace_table(s: dict[str, Any]) -> Table:
    t = Table("namespaces", "Namespaces",
              ["Namespace", "Family", "Scheme", "Ranks", "Files", "Blocks", "Bytes", "Held alone", "Shared"],
              numeric={4, 5, 6, 7, 8}, names={0})
    for n in s["namespaces"]:
        t.rows.append([n["source_base"], family_label(n), or_dash(n["scheme"]), ranks_label(n["ranks"]),
                       human_count(n["files"]), human_count(n["blocks"]), human_bytes(n["bytes"]),
                       human_bytes(n["bytes_alone"]), human_bytes(n["bytes_shared"])])
    o = s.get("outside_namespaces")
    if o:
        t.rows.append(["(outside namespaces)", ",".join(o.get("families") or ()) or "-", "-", "-",
                       human_count(o["files"]), "-", human_bytes(o["bytes"]),
                       "-", "-"])
    return t


RECLAIM_CLASSES = {"migrated": "--migrated", "unreadable_namespaces": "--unreadable-namespaces",
                   "residue": "--residue", "index_lost": "--index-lost"}


def reclaim_table(s: dict[str, Any]) -> Table | None:
    """What `kvmigrate prune` would take, per class, then per class and namespace: bytes it
    frees once purged (no other name holds them) apart from files it only unlinks (the
    target's hard link keeps their bytes: a file-count slot each). None when the summary
    carries no `reclaimable` (a summary not made by `report` or `audit`)."""
    r = s.get("reclaimable")
    if r is None:
        return None
    t = Table("reclaimable", "Reclaimable with prune",
              ["Class", "Namespace", "Files", "Bytes", "Freed files", "Freed bytes", "Unlinked files",
               "Unlinked bytes"], numeric={2, 3, 4, 5, 6, 7}, names={0, 1})

    def cells(v: dict[str, int]) -> list[str]:
        return [human_count(v["files"]), human_bytes(v["bytes"]), human_count(v["freed_files"]),
                human_bytes(v["freed_bytes"]), human_count(v["unlinked_files"]), human_bytes(v["unlinked_bytes"])]

    for cls, flag in RECLAIM_CLASSES.items():
        v = r["classes"].get(cls)
        if v and v["files"]:
            t.rows.append([flag, "(all)", *cells(v)])
            t.rows += [[flag, n["namespace"] or "(outside namespaces)", *cells(n)]
                       for n in r["namespaces"] if n["class"] == cls]
    # what a prune run now would skip, and why (else an empty table says nothing)
    t.rows += [["(skipped now)", f"{k['namespace']}: written {k['written_s_ago']} s ago, within prune's quiet period "
                f"({k['quiet_period_s'] / 60:.0f} min): rerun later or --force-live", *["-"] * 6]
               for k in r.get("skipped") or ()]
    # kept by every class: the target reads them only under their writer's topology, not stated
    t.rows += [["(orphaned by vLLM 0.34)", f"{o['namespace']}: reusable once --writer-tp/--writer-pp are stated "
                "(then migrate, and --migrated takes it); no class prunes it before",
                human_count(o["files"]), human_bytes(o["bytes"]), *["-"] * 4]
               for o in r.get("orphaned") or ()]
    from kvmigrate.report.hints import replicas_unhashed  # lazily: hints loads pyarrow (see cli.common.prefer_arrow_pool)

    listed = {v["namespace"] for v in r["namespaces"]}
    unhashed = [n["source_base"] for n in s["namespaces"] if n["source_base"] in listed and replicas_unhashed(s, n)]
    t.rows += [["(at least)", f"{base}: rank 0's files only (the other ranks' replicas are not "
                "hashed here; prune hashes them and takes those proven equal)", *["-"] * 6]
               for base in unhashed]
    if not t.rows:
        t.rows.append(["(nothing)", "nothing to prune", *["-"] * 6])
    return t


def reuse_table(s: dict[str, Any]) -> Table:
    t = Table("reuse", "Reuse",
              ["Namespace", "Reusable blocks", "Reusable bytes", "Pending blocks", "Not reusable blocks",
               "Not reusable bytes", "Gate", "Target"],
              numeric={1, 2, 3, 4, 5}, names={0, 7})
    for n in s["namespaces"]:
        t.rows.append([n["source_base"], human_count(n["reusable"]["blocks"]), human_bytes(n["reusable"]["bytes"]),
                       human_count(n["pending"]["blocks"]), human_count(n["not_reusable"]["blocks"]),
                       human_bytes(n["not_reusable"]["bytes"]), gate_label(n), or_dash(n["target_base"])])
    return t


def status_table(by_status: dict[str, dict[str, int]], key: str = "status", title: str = "Files by status") -> Table:
    from kvmigrate.report.summary import STATUS_BITS

    t = Table(key, title, ["Status", "Files", "Bytes", "Exit bits"], numeric={1, 2, 3}, names={0})
    for status, c in by_status.items():
        t.rows.append([status, human_count(c["files"]), human_bytes(c["bytes"]), str(STATUS_BITS.get(status, 1))])
    return t


def action_table(by_action: dict[str, dict[str, int]], key: str = "actions",
                 title: str = "Blocks by action", merges: dict[str, Any] | None = None) -> Table:
    """Blocks per action; with merge duplicates, a column of how many of them another source
    places (the dry run's "merge" line: its action lines count the rest)."""
    merged = (merges or {}).get("by_action") or {}
    t = Table(key, title, ["Action", "Blocks", "Bytes"] + (["Of which merge duplicates"] if merged else []),
              numeric={1, 2, 3}, names={0})
    for action, c in by_action.items():
        row = [action, human_count(c["blocks"]), human_bytes(c["bytes"])]
        if merged:
            row.append(human_count(merged.get(action, {}).get("blocks", 0)))
        t.rows.append(row)
    return t


def namespace_details(n: dict[str, Any]) -> list[tuple[str, str]]:
    """Key/value lines of one namespace (model, evidence, target, gate, facts, warnings)."""
    pairs = [
        ("model", or_dash(n["model_name"])),
        ("family", family_label(n) + (f" (evidence: {'; '.join(n['family_evidence'])})"
                                           if n["family_evidence"] else "")),
        ("scheme", or_dash(n["scheme"])),
        ("ranks", ranks_label(n["ranks"])),
    ]
    if n["status"] not in (None, "ok"):
        why = n.get("status_reason") or n.get("config_error")
        pairs.append(("namespace status", n["status"] + (f": {why}" if why else "")))
    if n["digest_ok"] is False:
        pairs.append(("digest", "config.json does not hash to the folder name"))
    if n["hash_bytes"]:
        pairs.append(("block hash", ", ".join(f"{b * 2} hex" for b in n["hash_bytes"])))
    if n["target_base"]:
        pairs.append(("target", f"{n['target_base']} ({or_dash(n['target_rank_dir'])}, "
                                f"{or_dash(n['target_profile'])})"))
    if n["target_error"]:
        pairs.append(("target refused", n["target_error"].splitlines()[0]))
    gate = n["gate"]
    if n["target_base"]:
        pairs.append(("gate", f"{gate_label(n)}: parallel_agnostic={_yes_no(gate['parallel_agnostic'])}, "
                              f"replicated_layout={_yes_no(gate['replicated_layout'])}"))
    for reason in gate["reasons"]:
        pairs.append(("gate reason", reason))
    if n["replicas"]["files"]:
        pairs.append(("replica copies", f"{plural(n['replicas']['files'], 'file')}, "
                                        f"{human_bytes(n['replicas']['bytes'])}"))
    pairs += merge_pairs(n)
    pairs.append(("held alone", human_bytes(n["bytes_alone"])))
    pairs.append(("shared (hard links)", human_bytes(n["bytes_shared"])))
    pairs += transform_pairs(n.get("transform_cost") or {})
    given = {k: v for k, v in n["facts"].items() if v is not None and k not in n["assumed_facts"]}
    if given:
        pairs.append(("facts", ", ".join(f"{k}={v}" for k, v in sorted(given.items()))))
    if n["assumed_facts"]:
        pairs.append(("assumed", ", ".join(f"{k}={v}" for k, v in sorted(n["assumed_facts"].items()))))
    for claim in n["claims"]:
        pairs.append(("warning", claim))
    for action, reasons in n["top_reasons"].items():
        for reason, count in reasons:
            pairs.append((f"{action} reason", f"{plural(count, 'file')}: {reason}"))
    return pairs


def _yes_no(v: Any) -> str:
    return "-" if v is None else ("yes" if v else "no")


def findings_table(s: dict[str, Any], *, notes: bool = True) -> Table:
    """Every finding, one row each; `notes=False` leaves the notes out (folded_notes_table)."""
    t = Table("findings", "Findings", ["Severity", "Code", "Namespace", "Files", "Bytes", "Finding"],
              numeric={3, 4}, names={1, 2})
    for f in s["findings"]:
        if not notes and f["severity"] == "note":
            continue
        t.rows.append([f["severity"], f["code"], or_dash(f["namespace"]),
                       "-" if f["files"] is None else human_count(f["files"]),
                       "-" if f["bytes"] is None else human_bytes(f["bytes"]),
                       f["message"] + (f" (e.g. {f['example']})" if f.get("example") else "")])
    return t


def folded_notes_table(s: dict[str, Any]) -> Table:
    """The notes (severity `note`), one row per distinct message: the same assumed facts in
    five namespaces are one row naming the five, so notes do not drown the findings."""
    t = Table("notes", "Notes", ["Code", "Namespaces", "Note"], names={0, 1})
    folded: dict[tuple[str, str], list[str]] = {}
    for f in s["findings"]:
        if f["severity"] == "note":
            folded.setdefault((f["code"], f["message"]), []).append(or_dash(f["namespace"]))
    for (code, message), where in folded.items():
        t.rows.append([code, ", ".join(where), message])
    return t


def exit_bits_label(code: int) -> str:
    """5 -> '1 findings + 4 integrity' (each bit with its value: interface.md §4)."""
    names = [f"{bit} {name}" for bit, name in EXIT_BITS if code & bit]
    return " + ".join(names) if names else "clean"


def header_pairs(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The run's settings; the target profile is the tree families' (an lmcache-* --target
    is the tiers' alone, shown per tier)."""
    from kvmigrate.families import tree_profile

    tiers = s.get("tiers") or []
    profiles = sorted({str(t["target_profile"]) for t in tiers})
    return [
        ("target profile", or_dash(s["target_profile"] and tree_profile(s["target_profile"]))),
        *([("LMCache tiers target", ", ".join(profiles) + f" ({plural(len(tiers), 'tier')})")] if tiers else []),
        ("verify", or_dash(s["verify"])),
        ("scanned by", or_dash(s["command"])),
        ("manifest", or_dash(s["manifest"])),
    ] + [("partial", selection_note(step)) for step in s.get("selection") or ()]


def selection_note(step: dict[str, Any]) -> str:
    """One --only/--exclude step of a partial scan or report, e.g. "scan --only 'Qwen/*': 2 namespaces left out"."""
    skipped = len(step.get("skipped_namespaces") or ())
    outside = ", and every file outside namespaces" if step["by"] == "scan" else ""
    return (f"{step['by']} {Selection.of(step.get('only') or (), step.get('exclude') or ()).flags()}: "
            f"{plural(skipped, 'namespace')} left out{outside}")


# --- LMCache tiers (report/tiers.py) ------------------------------------------------------

TIER_CLASSES = {"residue": "--residue", "index_lost": "--index-lost", "unreadable_namespaces": "--unreadable-namespaces"}


def tier_table(s: dict[str, Any]) -> Table | None:
    """One row per LMCache tier: its target, deployments, files and what each prune class
    could take (None: the root has no tier)."""
    tiers = s.get("tiers") or []
    if not tiers:
        return None
    t = Table("tiers", "LMCache tiers", ["Tier", "Target profile", "Backends", "Deployments", "Files", "Bytes",
                                         "Residue", "Index lost", "Unreadable namespaces"],
              numeric={3, 4, 5, 6, 7, 8}, names={0})
    for tier in tiers:
        r = tier["reclaimable"]
        t.rows.append([tier["tier"], or_dash(tier["target_profile"]), ",".join(tier["backends"]) or "-",
                       str(len(tier["deployments"])), human_count(tier["files"]), human_bytes(tier["bytes"]),
                       *(human_bytes(r[c]["bytes"]) for c in TIER_CLASSES)])
    return t


def tier_pairs(tier: dict[str, Any]) -> list[tuple[str, str]]:
    pairs = [("target profile", or_dash(tier["target_profile"])), ("backends", ", ".join(tier["backends"]) or "-"),
             ("files", f"{human_count(tier['files'])} ({human_bytes(tier['bytes'])})")]
    if tier["other_files"]:
        pairs.append(("files of no deployment", ", ".join(f"{k} {human_count(v['files'])}"
                                                          for k, v in tier["other_files"].items())))
    return pairs


def tier_deployment_pairs(d: dict[str, Any]) -> list[tuple[str, str]]:
    return [("backend", d["backend"]), ("scheme", or_dash(d["scheme"])), ("model", or_dash(d["model"])),
            ("ws", or_dash(d["ws"])), ("dtype", or_dash(d["dtype"])),
            ("target", f"{or_dash(d['target_base'])} ({or_dash(d['target_profile'])})")]


def _equal_label(v: Any) -> str:
    return "not known" if v is None else "yes" if v else "NO"


def recipe_table(d: dict[str, Any]) -> Table:
    """§3.2's hash recipe, writer vs target, with where each value came from."""
    t = Table(f"recipe-{d['deployment']}", "Hash recipe",
              ["Component", "Writer", "Writer source", "Target", "Target source", "Equal"])
    for c in d["recipe"]:
        t.rows.append([c["component"], or_dash(c["writer"]), c["writer_source"], or_dash(c["target"]),
                       c["target_source"], _equal_label(c["equal"])])
    return t


def tier_reclaim_table(reclaim: dict[str, dict[str, int]], key: str) -> Table:
    """Per prune class, the files a deployment (or a tier) holds that it could take."""
    t = Table(key, "Reclaimable per class", ["Class", "Files", "Bytes"], numeric={1, 2}, names={0})
    for cls, flag in TIER_CLASSES.items():
        v = reclaim.get(cls) or {"files": 0, "bytes": 0}
        t.rows.append([flag, human_count(v["files"]), human_bytes(v["bytes"])])
    return t


def tier_blocks(s: dict[str, Any]) -> list[tuple[str, list[tuple[str, str]], list[tuple[str, list[tuple[str, str]],
                                                                                           list[Table]]]]]:
    """Per tier: (title, its pairs, per deployment (label, pairs, tables)), in tier order:
    what every renderer prints of the tiers."""
    out = []
    for tier in s.get("tiers") or []:
        deps = []
        for d in tier["deployments"]:
            tables = [recipe_table(d), status_table(d["by_status"], key=f"status-{d['deployment']}")]
            if d["by_action"]:
                tables.append(action_table(d["by_action"], key=f"actions-{d['deployment']}"))
            tables.append(tier_reclaim_table(d["reclaimable"], f"reclaim-{d['deployment']}"))
            deps.append((d["deployment"], tier_deployment_pairs(d), tables))
        out.append((f"tier {tier['tier']}", tier_pairs(tier), deps))
    return out


# --- Mooncake stores (report/stores.py) ---------------------------------------------------


def store_table(s: dict[str, Any]) -> Table | None:
    """One row per Mooncake store: backends, client roots, locks, largest bucket id, the
    writer's release, its files and objects, what the next client start deletes (None: the
    root has no store)."""
    from kvmigrate.report.stores import lock_label

    stores = s.get("stores") or []
    if not stores:
        return None
    t = Table("stores", "Mooncake stores", ["Store", "Backends", "Client roots", "Locks", "Largest bucket id",
                                            "Writer release", "Deployments", "Files", "Bytes", "Objects",
                                            "Object bytes", "Start deletes"],
              numeric={6, 7, 8, 9, 10, 11}, names={0})
    for st in stores:
        gone = sum(c["bytes"] for c in st["start_deletes"].values())
        t.rows.append([st["store"], ",".join(st["backends"]) or "-", ",".join(st["client_roots"]) or "-",
                       lock_label(st), or_dash(st["largest_bucket_id"]), or_dash(st["writer_release"]),
                       str(len(st["deployments"])), human_count(st["files"]), human_bytes(st["bytes"]),
                       human_count(st["objects"]), human_bytes(st["object_bytes"]), human_bytes(gone)])
    return t


def store_line(st: dict[str, Any]) -> str:
    """One line of a Mooncake store for the scan's text summary."""
    from kvmigrate.report.stores import lock_label

    line = (f"  store {st['store']}: {', '.join(st['backends']) or 'no backend'}; client roots "
            f"{', '.join(st['client_roots']) or '-'}; locks {lock_label(st)}; writer release "
            f"{or_dash(st['writer_release'])} ({st['writer_release_evidence']}); "
            f"{plural(st['objects'], 'object')} ({human_bytes(st['object_bytes'])})")
    gone = st["start_deletes"]
    if gone:
        line += (f"; the next client start deletes {plural(sum(c['files'] for c in gone.values()), 'file')} "
                 f"({human_bytes(sum(c['bytes'] for c in gone.values()))})")
    if st["start_refuses"]["files"]:
        line += f"; {plural(st['start_refuses']['files'], 'KVEntry file')} stop a client from starting"
    return line


def store_pairs(st: dict[str, Any]) -> list[tuple[str, str]]:
    from kvmigrate.report.stores import lock_label

    pairs = [("backends", ", ".join(st["backends"]) or "-"), ("client roots", ", ".join(st["client_roots"]) or "-"),
             ("locks", lock_label(st)), ("largest bucket id", or_dash(st["largest_bucket_id"])),
             ("writer release", f"{or_dash(st['writer_release'])} ({st['writer_release_evidence']})"),
             ("engine stopped", "stated" if st["engine_stopped"] else "not stated"),
             ("files", f"{human_count(st['files'])} ({human_bytes(st['bytes'])} on disk)"),
             ("objects", f"{human_count(st['objects'])} ({human_bytes(st['object_bytes'])})")]
    if st["start_deletes"]:
        pairs.append(("next client start deletes", ", ".join(
            f"{k} {human_count(v['files'])} ({human_bytes(v['bytes'])})" for k, v in st["start_deletes"].items())))
    if st["start_refuses"]["files"]:
        pairs.append(("KVEntries that stop a start", human_count(st["start_refuses"]["files"])))
    return pairs


def store_deployment_pairs(d: dict[str, Any]) -> list[tuple[str, str]]:
    return [("engine", d["engine"]), ("scheme", or_dash(d["scheme"])), ("model", or_dash(d["model"])),
            ("key ranks", f"{d['key_ranks']} (writer TP {or_dash(d['writer_tp'])})"), ("kind", or_dash(d["kv_kind"])),
            ("target", f"{or_dash(d['target'])} ({or_dash(d['target_profile'])})"),
            ("objects", f"{human_count(d['objects'])} ({human_bytes(d['object_bytes'])}); on disk "
                        f"{human_count(d['files'])} KVEntry files ({human_bytes(d['bytes'])})")]


def object_table(counts: dict[str, dict[str, int]], key: str, first: str, title: str) -> Table:
    t = Table(key, title, [first, "Objects", "Bytes"], numeric={1, 2}, names={0})
    for name, c in counts.items():
        t.rows.append([name, human_count(c["objects"]), human_bytes(c["bytes"])])
    return t


def store_reclaim_table(reclaim: dict[str, dict[str, int]], key: str) -> Table:
    """Per prune class (mooncake.md §6): files it moves and the bytes freed; objects it
    retires; bytes of those that stay in live pairs until Mooncake evicts them."""
    from kvmigrate.report.stores import CLASSES

    t = Table(key, "Reclaimable per class", ["Class", "Files", "Bytes", "Objects", "Held in live pairs"],
              numeric={1, 2, 3, 4}, names={0})
    for cls, flag in CLASSES.items():
        v = reclaim.get(cls) or {"files": 0, "bytes": 0, "objects": 0, "held_bytes": 0}
        t.rows.append([flag, human_count(v["files"]), human_bytes(v["bytes"]), human_count(v["objects"]),
                       human_bytes(v["held_bytes"])])
    return t


def store_blocks(s: dict[str, Any]) -> list[tuple[str, list[tuple[str, str]], list[Table],
                                                  list[tuple[str, list[tuple[str, str]], list[Table]]]]]:
    """Per store: (title, its pairs, its tables, per deployment (label, pairs, tables)), in
    store order: what every renderer prints of the stores."""
    out = []
    for st in s.get("stores") or []:
        deps = []
        for d in st["deployments"]:
            label = d["deployment"]
            tables = [object_table(d["by_status"], f"objects-status-{label}", "Status", "Objects by status"),
                      object_table(d["by_action"], f"objects-action-{label}", "Action", "Objects by action"),
                      store_reclaim_table(d["reclaimable"], f"reclaim-{label}")]
            deps.append((label, store_deployment_pairs(d), tables))
        out.append((f"store {st['store']}", store_pairs(st),
                    [store_reclaim_table(st["reclaimable"], f"reclaim-store-{st['store']}")], deps))
    return out


# --- diff -----------------------------------------------------------------------------

def _signed_count(n: int) -> str:
    return ("+" if n > 0 else "") + human_count(n)


def _signed_bytes(n: int) -> str:
    return ("+" if n > 0 else "") + human_bytes(n)


def diff_tables(d: dict[str, Any]) -> list[Table]:
    changes = Table("diff_namespaces", "Namespaces",
                    ["Namespace", "Change", "Files", "Files Δ", "Bytes", "Bytes Δ", "Held alone Δ", "Shared Δ",
                     "Blocks Δ", "Reusable blocks Δ"],
                    numeric={2, 3, 4, 5, 6, 7, 8, 9}, names={0})
    for n in d["namespaces"]:
        changes.rows.append([n["source_base"], n["change"], human_count(n["new"]["files"]),
                             _signed_count(n["delta"]["files"]), human_bytes(n["new"]["bytes"]),
                             _signed_bytes(n["delta"]["bytes"]), _signed_bytes(n["delta"]["bytes_alone"]),
                             _signed_bytes(n["delta"]["bytes_shared"]), _signed_count(n["delta"]["blocks"]),
                             _signed_count(n["delta"]["reusable_blocks"])])
    findings = Table("diff_findings", "New or grown findings",
                     ["Namespace", "Status", "Files before", "Files now", "Files Δ", "Bytes Δ"],
                     numeric={2, 3, 4, 5}, names={0, 1})
    for f in d["new_findings"]:
        findings.rows.append([or_dash(f["namespace"]), f["status"], human_count(f["old_files"]),
                              human_count(f["new_files"]), _signed_count(f["new_files"] - f["old_files"]),
                              _signed_bytes(f["new_bytes"] - f["old_bytes"])])
    gone = Table("diff_resolved", "Resolved or shrunk findings",
                 ["Namespace", "Status", "Files before", "Files now"], numeric={2, 3}, names={0, 1})
    for f in d["resolved_findings"]:
        gone.rows.append([or_dash(f["namespace"]), f["status"], human_count(f["old_files"]),
                          human_count(f["new_files"])])
    return [changes, findings, gone]


def _from_to(old: int, new: int) -> str:
    return f"{human_bytes(old)} -> {human_bytes(new)} ({_signed_bytes(new - old)})"


def diff_totals_pairs(d: dict[str, Any]) -> list[tuple[str, str]]:
    o, n = d["old"]["totals"], d["new"]["totals"]
    return [
        ("old", f"{or_dash(d['old']['manifest'])} ({or_dash(d['old']['root'])})"),
        ("new", f"{or_dash(d['new']['manifest'])} ({or_dash(d['new']['root'])})"),
        ("files", f"{human_count(o['files'])} -> {human_count(n['files'])} ({_signed_count(n['files'] - o['files'])})"),
        ("bytes", f"{human_bytes(o['bytes'])} -> {human_bytes(n['bytes'])} ({_signed_bytes(n['bytes'] - o['bytes'])})"),
        ("held alone", _from_to(o["bytes_alone"], n["bytes_alone"])),
        ("shared (hard links)", _from_to(o["bytes_shared"], n["bytes_shared"])),
        ("data on disk", _from_to(o["data_bytes"], n["data_bytes"]) + " (a hard-linked file counted once: "
                                                                    "new data, not new paths)"),
        ("blocks", f"{human_count(o['blocks'])} -> {human_count(n['blocks'])} "
                   f"({_signed_count(n['blocks'] - o['blocks'])})"),
        ("reusable blocks", f"{human_count(o['reusable_blocks'])} -> {human_count(n['reusable_blocks'])} "
                            f"({_signed_count(n['reusable_blocks'] - o['reusable_blocks'])})"),
        ("new namespaces", str(len(d["new_namespaces"]))),
        ("vanished namespaces", str(len(d["vanished_namespaces"]))),
        ("exit code", f"{exit_label(d['old']['exit_code'])} -> {exit_label(d['new']['exit_code'])}"),
    ]
