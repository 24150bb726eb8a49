"""`kvmigrate explain MANIFEST NAMESPACE`: from a manifest alone, why a namespace has the
target it has and what keeps its other blocks from being reused (interface.md §1).

The target's gates are evaluated again from what the manifest recorded (the source
config.json, the resolved facts, the profile): every condition is listed, passed or
not, with the facts it read and where each came from (a flag, a FACTS.json key, a model
config, or assumed). The blocks that are not reusable are grouped by their typed columns
(status, action, finding, asks), each class with its reason and the command that would
change it, taken from the report's hints (kvmigrate.report.hints), so `explain` and
`report` never advise differently. Nothing under the cache root is read.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from kvmigrate import findings as fd
from kvmigrate import manifest as mf
from kvmigrate.errors import UsageError
from kvmigrate.identity import gates
from kvmigrate.identity.facts import FACT_NAMES, FLAGS, Facts
from kvmigrate.identity.values import LMCACHE_FACTS, MOONCAKE_FACTS, ORPHANED
from kvmigrate.identity.vllm_target import gate_deployment
from kvmigrate.report.hints import fact_flag
from kvmigrate.report.render import check_manifest, summary_of
from kvmigrate.report.stores import CLASSES, lock_label
from kvmigrate.report.summary import BATCH_ROWS, NEEDS_ACTIONS, NOT_BLOCK_STATUSES, REUSABLE_ACTIONS
from kvmigrate.units import human_bytes, plural

if TYPE_CHECKING:  # the JSON models are types only (kvmigrate.outputs)
    from kvmigrate.outputs import (
        ExplainClass,
        ExplainFact,
        ExplainGate,
        ExplainOutput,
        ExplainStore,
        ExplainTier,
        Hint,
        Namespace,
        Store,
        Tier,
    )

GATE_NAMES = {"G1": "parallel-agnostic namespace (G1)", "G2": "parallel-agnostic namespace (G2)",
              "canonical": "parallel-agnostic namespace, canonical rows", "R": "replicated layout (R)"}
_COLUMNS = ["source_base", "status", "action", "finding", "asks", "reason", "size", "group", "block_hash", "rank"]


def explain(path: str | os.PathLike[str], namespace: str) -> ExplainOutput:
    """The object `kvmigrate explain MANIFEST NAMESPACE --json` prints."""
    meta = check_manifest(path)
    namespaces: dict[str, dict[str, Any]] = meta.get("namespaces") or {}
    base = _resolve(namespace, namespaces, str(path))
    ns = namespaces[base]
    summary = summary_of(path)
    entry = next(n for n in summary["namespaces"] if n["source_base"] == base)
    hints = [h for h in summary["hints"] if base in h["namespaces"]]
    facts = _facts(ns, meta)
    target = ns.get("target") or None
    conditions, gate_note = _conditions(ns, target, facts)
    result: ExplainOutput = {
        "manifest": os.path.abspath(path), "namespace": base, "model_name": ns.get("model_name"),
        "family": ns.get("family"), "scheme": ns.get("scheme"),
        "ranks": list(ns.get("ranks") or []) or _row_ranks(path, base),
        "status": ns.get("status"), "status_reason": ns.get("status_reason") or None,
        "target_profile": meta.get("target_profile"),
        "target": None if target is None else {
            "profile": target.get("profile"), "family": target.get("family"), "base_name": target.get("base_name"),
            "rank_dir": target.get("rank_dir"), "parallel_agnostic": target.get("parallel_agnostic"),
            "replicated_layout": target.get("replicated_layout"), "unreachable": target.get("unreachable"),
            "missing_facts": target.get("missing_facts"), "decisive_assumptions": target.get("decisive_assumptions")},
        "target_error": ns.get("target_error"),
        "gates": conditions, "gate_note": gate_note, "facts": list(facts.values()),
        "blocks": entry["blocks"], "reusable": entry["reusable"], "pending": entry["pending"],
        "not_reusable": _classes(path, base, len(ns.get("ranks") or []), entry, hints),
        "why": None, "command": None,
        "tier": _tier(summary.get("tiers") or [], base),
        "store": _store(summary.get("stores") or [], base),
    }
    result["why"], result["command"] = _why(result, entry, hints)
    return result


def _tier(tiers: list[Tier], base: str) -> ExplainTier | None:
    """The tier entry of an LMCache deployment (report/tiers.py), None for any other namespace."""
    for t in tiers:
        for d in t["deployments"]:
            if d["deployment"] == base:
                return {"tier": t["tier"], "deployment": d}
    return None


def _store(stores: list[Store], base: str) -> ExplainStore | None:
    """A Mooncake store's entry (report/stores.py) for its own namespace or one of its
    deployments; None for any other namespace."""
    for s in stores:
        if s["namespace"] == base:
            return {"store": s, "deployment": None}
        for d in s["deployments"]:
            if d["deployment"] == base:
                return {"store": s, "deployment": d}
    return None


def _resolve(name: str, namespaces: dict[str, dict[str, Any]], path: str) -> str:
    """The source base NAME means: itself, or the one namespace with that model or target name."""
    if name in namespaces:
        return name
    found = sorted(b for b, m in namespaces.items()
                   if name in (m.get("model_name"), (m.get("target") or {}).get("base_name"))
                   or _is_store_named(m, name))
    if len(found) == 1:
        return found[0]
    shown = ", ".join(found or sorted(namespaces)[:5]) or "none"
    if found:
        raise UsageError(f"{name!r} names {len(found)} namespaces of the manifest: {shown}", path=path,
                         hint="pass one source base folder name")
    raise UsageError(f"no namespace {name!r} in the manifest (namespaces: {shown}"
                     + (", ..." if len(namespaces) > 5 else "") + ")", path=path,
                     hint=f"pass a source base folder name, a model name or a target base name; "
                          f"`kvmigrate report {path}` lists them")


_STORE_SHARED_FACTS = ("target_model_name", "target_tp", "engine_stopped")  # LMCache's, read by Mooncake too


def _store_family(name: Any) -> bool:
    """Whether a namespace's family keeps stores (Mooncake): its facts are read there."""
    from kvmigrate import families

    return isinstance(name, str) and families.get(name).root_layout == "stores"


def _is_store_named(meta: dict[str, Any], name: str) -> bool:
    """The namespace of a store's own files, named by the store's relpath (mooncake.md §1.1)."""
    fields = meta.get("config_json") or {}
    return "client_roots" in fields and str(fields.get("store")) == name.rstrip("/")


def _facts(ns: dict[str, Any], meta: dict[str, Any]) -> dict[str, ExplainFact]:
    """Every deployment fact with its value and where it came from."""
    given = ns.get("facts") or {}
    sources = ns.get("facts_source") or {}
    assumed = ns.get("assumed_facts") or {}
    facts_file = (meta.get("facts") or {}).get("facts_file")
    out: dict[str, ExplainFact] = {}
    lmcache = str(ns.get("deployment") or "").startswith("lmcache:")
    stores = _store_family(ns.get("family"))
    for name in FACT_NAMES:
        if name in LMCACHE_FACTS and not lmcache and not (stores and name in _STORE_SHARED_FACTS):
            continue  # (facts only LMCache tiers read)
        if name in MOONCAKE_FACTS and not stores:
            continue  # (facts only Mooncake stores read)
        source = sources.get(name)
        if source == "flag":
            where = f"flag {FLAGS.get(name, fact_flag(name))}"
        elif source and source.startswith("facts:"):
            where = f"FACTS.json key {source.removeprefix('facts:')!r}" + (f" ({facts_file})" if facts_file else "")
        elif source and source.startswith("model_config:"):
            where = f"model config {source.removeprefix('model_config:')}"
        elif name in assumed:
            where = "assumed: vLLM's default"
        else:
            where = "not given"
        value = given.get(name) if given.get(name) is not None else assumed.get(name)
        out[name] = {"name": name, "value": value, "source": where, "flag": fact_flag(name)}
    return out


def _conditions(ns: dict[str, Any], target: dict[str, Any] | None,
                facts: dict[str, ExplainFact]) -> tuple[list[ExplainGate], str | None]:
    """The gate conditions evaluated again from the recorded identity and facts, and a note
    when no gate decides (no target, vllm.cpp, a profile without gates, a collapsed source)."""
    if target is None:
        return [], None
    profile = target.get("profile")
    if profile not in gates.PROFILE_GATES:
        return [], f"{profile}: the target is the same deployment's namespace (no parallel-agnostic gate)"
    if str(target.get("unreachable") or "").startswith(ORPHANED):
        return [], target["unreachable"]
    dep = gate_deployment(ns.get("config_json") or {})
    writer = target.get("writer_topology")
    if writer:  # a collapsed folder, judged at the topology the operator stated
        dep = gates.Deployment(tp=writer[0], pp=writer[1], num_groups=len((ns.get("config_json") or {})
                                                                         .get("kv_cache_groups") or []))
    if dep is None:
        return [], "the source is already collapsed (parallel-agnostic or replicated): no gate is evaluated"
    if gates.PROFILE_GATES[profile][0] is None:
        return [], f"{profile} has no parallel-agnostic namespaces: every deployment keeps its own"
    recorded = Facts.from_dict(ns.get("facts") or {})
    conds: list[gates.Condition] = []
    decision = gates.evaluate(profile, dep, recorded, conds)
    note = None
    if (decision.parallel_agnostic, decision.replicated_layout) != (target.get("parallel_agnostic"),
                                                                    target.get("replicated_layout")):
        note = ("the manifest's decision differs from this version's gates: it was written by another version "
                "(rescan to decide again)")
    return [{"gate": c.gate, "gate_name": GATE_NAMES.get(c.gate, c.gate), "needs": c.needs, "passed": c.passed,
             "reason": c.reason or None, "facts": [facts[f] for f in c.facts]} for c in conds], note


def _classes(path: str | os.PathLike[str], base: str, ranks: int, entry: Namespace,
             hints: list[Hint]) -> list[ExplainClass]:
    """Blocks not reusable, by (status, action, finding, asks) of their lowest-rank row
    that is not only a pointer to another (the row the summary counts a block by), with the
    bytes of all their rank files, the most common reason and the hint that would change it.

    The rows are streamed: a block is classed once its `ranks` rank files have come (a
    block's rank files are written side by side), so only the rows of blocks split between
    batches wait; without a rank list every block waits for the end."""
    classes = _ClassTally()
    waiting: list[pa.Table] = []  # rows of the blocks whose rank files have not all come
    seq = 0
    for batch in mf.iter_batches(path, columns=_COLUMNS, batch_size=BATCH_ROWS):
        t = pa.Table.from_batches([batch])
        t = pa.table({c: pc.cast(t[c], pa.string()) if pa.types.is_dictionary(t[c].type) else t[c]
                      for c in _COLUMNS})
        t = t.append_column("seq", pa.array(range(seq, seq + t.num_rows), pa.int64()))  # (manifest order)
        seq += t.num_rows
        block = pc.and_(pc.equal(t["source_base"], base), pc.is_valid(t["block_hash"]))
        block = pc.and_(block, pc.invert(pc.is_in(t["status"], pa.array(sorted(NOT_BLOCK_STATUSES)))))
        t = t.filter(pc.fill_null(block, False))
        if not t.num_rows:
            continue
        kept = pc.fill_null(pc.invert(pc.is_in(t["action"], pa.array(list(REUSABLE_ACTIONS)))), False)
        rows = (t.drop_columns(["source_base"]).append_column("kept", kept)  # (a reusable row: a rank file only)
                .append_column("gkey", pc.fill_null(t["group"], _NO_GROUP)))
        waiting.append(rows)
        if not ranks:
            continue
        rows = pa.concat_tables(waiting)
        seen = rows.group_by(_BLOCK, use_threads=False).aggregate([([], "count_all")])
        rows = rows.join(seen, keys=_BLOCK, join_type="inner")
        done = pc.greater_equal(rows["count_all"], ranks)
        classes.add(_blocks(rows.filter(done)))
        waiting = [rows.filter(pc.invert(done)).drop_columns(["count_all"])]
    if waiting:
        classes.add(_blocks(pa.concat_tables(waiting)))
    out: list[ExplainClass] = []
    for (status, action, finding, asks), (count, nbytes, reasons) in classes.ordered():
        reason = max(reasons.items(), key=lambda r: (r[1], r[0] or ""))[0] if reasons else None
        command, why = _command_for(status, action, finding, asks, entry, hints)
        out.append({"status": status, "action": action, "finding": finding, "asks": asks, "blocks": count,
                    "bytes": nbytes or 0, "reason": reason, "command": command, "why": why})
    return sorted(out, key=lambda c: (-c["blocks"], c["status"] or "", c["action"] or ""))


_CLASS_KEYS = ("status", "action", "finding", "asks", "reason")
_BLOCK = ["gkey", "block_hash"]  # a block: its group (none: _NO_GROUP, as a join key must be set) and hash
_NO_GROUP = -(1 << 31)
_NO_RANK = 1 << 62  # (after every rank, as a rank of none sorts)


def _blocks(rows: pa.Table) -> pa.Table:
    """The not reusable blocks among complete blocks' rows: per block, the first value of
    each class key in (not a pointer, rank, manifest) order, the bytes of its kept rows,
    and where its lead row sorts; blocks whose lead row is only a pointer left out."""
    rows = rows.filter(rows["kept"])
    rows = rows.append_column("secondary", pc.fill_null(pc.is_in(rows["finding"], pa.array(list(fd.SECONDARY))),
                                                        False))
    rows = rows.append_column("rank_key", pc.fill_null(pc.cast(rows["rank"], pa.int64()), _NO_RANK))
    rows = rows.take(pc.sort_indices(rows, [("secondary", "ascending"), ("rank_key", "ascending"),
                                            ("seq", "ascending")]))
    blocks = rows.group_by(_BLOCK, use_threads=False).aggregate(
        [(k, "first") for k in (*_CLASS_KEYS, "secondary", "rank_key", "seq")] + [("size", "sum")])
    return blocks.filter(pc.invert(blocks["secondary_first"]))  # a block whose lead row is reusable


class _ClassTally:
    """Per class of not reusable blocks: [blocks, bytes, {reason: blocks}], and where its
    first block's lead row sorts (the order the classes are found in, all rows sorted)."""

    def __init__(self) -> None:
        self.counts: dict[tuple, list[Any]] = {}
        self.first: dict[tuple, tuple[int, int]] = {}

    def add(self, blocks: pa.Table) -> None:
        if not blocks.num_rows:
            return
        keys = [f"{k}_first" for k in _CLASS_KEYS]
        agg = blocks.group_by(keys, use_threads=False).aggregate(
            [([], "count_all"), ("size_sum", "sum"), ("rank_key_first", "min")])
        for status, action, finding, asks, reason, n, nbytes in zip(*(agg[c].to_pylist() for c in (
                *keys, "count_all", "size_sum_sum"))):
            c = self.counts.setdefault((status, action, finding, asks), [0, 0, {}])
            c[0] += n
            c[1] += nbytes or 0
            c[2][reason] = c[2].get(reason, 0) + n
        firsts = blocks.sort_by([("rank_key_first", "ascending"), ("seq_first", "ascending")]).group_by(
            keys[:4], use_threads=False).aggregate([("rank_key_first", "first"), ("seq_first", "first")])
        for status, action, finding, asks, rank, row in zip(*(firsts[c].to_pylist() for c in (
                *keys[:4], "rank_key_first_first", "seq_first_first"))):
            key = (status, action, finding, asks)
            self.first[key] = min(self.first.get(key, (rank, row)), (rank, row))

    def ordered(self) -> list[tuple[tuple, list[Any]]]:
        return sorted(self.counts.items(), key=lambda kv: self.first[kv[0]])


def _row_ranks(path: str | os.PathLike[str], base: str) -> list[int]:
    """The ranks a namespace's rows carry (a flat family's deployment records none: its
    ranks are in the file names)."""
    ranks: set[int] = set()
    for batch in mf.iter_batches(path, columns=["source_base", "rank"]):
        t = pa.Table.from_batches([batch])
        sb = t["source_base"]
        sb = pc.cast(sb, pa.string()) if pa.types.is_dictionary(sb.type) else sb
        ranks.update(r for r in t.filter(pc.fill_null(pc.equal(sb, base), False))["rank"].to_pylist() if r is not None)
    return sorted(ranks)


def _same(col: pa.ChunkedArray, value: Any) -> pa.ChunkedArray:
    return pc.is_null(col) if value is None else pc.fill_null(pc.equal(col, value), False)


def _command_for(status: str, action: str, finding: str | None, asks: str | None, entry: Namespace,
                 hints: list[Hint]) -> tuple[str | None, str]:
    """The report's hint for a class of blocks (by the codes it answers), else why none can."""
    codes: list[str | None] = [status] if status not in (None, "ok") else []
    if asks and "--family" in asks:
        codes.append("family_ambiguous")
    codes += [action, finding]
    if status in (None, "ok") and action == "none":
        codes.append("target_refused")  # a namespace without a target: all its blocks
    for code in codes:
        hint = next((h for h in hints if code and code in h["codes"]), None)
        if hint is not None:
            return hint["command"], hint["why"]
    if finding == fd.TARGET_OCCUPIED:
        return None, "the target path holds other bytes: kvmigrate never overwrites it (a conflict)"
    if entry.get("target_unreachable"):
        return None, f"no command changes it: {entry['target_unreachable']}"
    if action in NEEDS_ACTIONS:
        return None, "their numbers are not proven: migrate --apply skips them (the reason says why)"
    return None, "no command changes it (the reason says why)"


def _why(result: ExplainOutput, entry: Namespace, hints: list[Hint]) -> tuple[str, str | None]:
    """One sentence on the target, and the command that would change it (if one would)."""
    target = result["target"]
    if target is None:
        hint = next((h for h in hints if {"target_refused", result["status"]} & set(h["codes"])), None)
        why = (f"no target namespace: {result['target_error']}" if result["target_error"] else
               f"no target namespace: the namespace is {result['status']} ({result['status_reason']})")
        return why, hint["command"] if hint else None
    if target["base_name"] is None:  # a flat family: pages, not folders (docs/families.md §3)
        return (f"a flat directory: {target['profile']} opens each page of {result['namespace']} by name, in the "
                "same directory (each row's target_relpath in the manifest); no folder or gate decides it"), None
    failed = sorted({c["gate"] for c in result["gates"] if not c["passed"]})
    if target["replicated_layout"]:
        kind = "the replicated-layout namespace (gate R passed)"
    elif target["parallel_agnostic"]:
        kind = "the parallel-agnostic namespace" + (" (its gates passed)" if result["gates"] else "")
    elif result["gates"]:
        kind = "the writer's own deployment namespace: " + ", ".join(f"gate {g} failed" for g in failed)
    else:
        kind = "the writer's own deployment namespace"
    why = f"{target['base_name']} is {kind}"
    missing, assumed = target["missing_facts"], target["decisive_assumptions"]
    if missing:
        hint = next((h for h in hints if "target_guessed" in h["codes"]), None)
        return (why + "; a guess: " + ", ".join(fact_flag(f) for f in missing)
                + " not given would change it"), hint["command"] if hint else None
    if assumed:
        why += "; it rests on the assumed " + ", ".join(f"{k}={v}" for k, v in sorted(assumed.items()))
    return why, None


def render_text(r: ExplainOutput) -> str:
    lines = [f"namespace    {r['namespace']}   ({r['family']} {r['scheme']}, model {r['model_name']}, "
             f"ranks {r['ranks']})"]
    if r["status"] not in (None, "ok"):
        lines.append(f"status       {r['status']}: {r['status_reason']}")
    t = r["target"]
    if t is not None and t["base_name"] is None:
        lines.append(f"target       {t['profile']}: the pages of deployment {r['namespace']}, by name, in the "
                     "same directory")
    elif t is not None and (r["tier"] is not None or r["store"] is not None):  # (names, no folders)
        lines.append(f"target       {t['profile']}: {t['base_name']}")
    elif t is not None:
        lines.append(f"target       {t['profile']}: {t['base_name']}   blocks under {t['rank_dir']}/")
    lines.append(f"why          {r['why']}")
    if r["command"]:
        lines.append(f"             $ {r['command']}")
    if r["gate_note"]:
        lines.append(f"gates        {r['gate_note']}")
    gate = None
    for c in r["gates"]:
        if c["gate"] != gate:
            gate = c["gate"]
            lines.append(f"gate {c['gate_name']}:")
        facts = "; ".join(f"{f['name']}={_value(f['value'])} ({f['source']})" for f in c["facts"]) or "config.json"
        mark = "pass" if c["passed"] else "FAIL"
        lines.append(f"  [{mark}] {c['needs']}: " + (facts if c["passed"] else f"{c['reason']}; {facts}"))
    if r["tier"] is not None:
        lines += _tier_lines(r["tier"])
    if r["store"] is not None:
        lines += _store_lines(r["store"])
    lines.append("facts:")
    width = max(len(f["name"]) for f in r["facts"])
    for f in r["facts"]:
        lines.append(f"  {f['name'].ljust(width)}  {_value(f['value'])}  ({f['source']}; {f['flag']})")
    lines.append(f"blocks       {_count(r['blocks'])}: {_count(r['reusable']['blocks'])} reusable "
                 f"({_count(r['pending']['blocks'])} pending)")
    if r["not_reusable"]:
        lines.append("not reusable:")
    for k in r["not_reusable"]:
        what = ", ".join(x for x in (f"status {k['status']}", f"action {k['action']}",
                                     f"finding {k['finding']}" if k["finding"] else "",
                                     f"asks {k['asks']}" if k["asks"] else "") if x)
        lines.append(f"  {plural(k['blocks'], 'block')} "
                     f"({human_bytes(k['bytes'])}): {what}")
        if k["reason"]:
            lines.append(f"    reason: {k['reason']}")
        lines.append(f"    {'$ ' + k['command'] if k['command'] else k['why']}")
    return "\n".join(lines).encode("utf-8", "backslashreplace").decode("utf-8") + "\n"


def _tier_lines(t: ExplainTier) -> list[str]:
    """An LMCache deployment: its tier, target names, §3.2's recipe comparison with each
    value's source, and its files by status and blocks by action."""
    d = t["deployment"]
    lines = [f"tier         {t['tier']} ({d['backend']}, {d['scheme']}, ws {d['ws']}, {d['dtype'] or 'no dtype'})",
             f"target names {d['target_base'] or 'none'} ({d['target_profile']})",
             "hash recipe (writer vs target):"]
    width = max((len(c["component"]) for c in d["recipe"]), default=0)
    for c in d["recipe"]:
        mark = "?" if c["equal"] is None else "=" if c["equal"] else "DIFFERS"
        lines.append(f"  {c['component'].ljust(width)}  [{mark}] writer {_value(c['writer'])} ({c['writer_source']}); "
                     f"target {_value(c['target'])} ({c['target_source']})")
    lines.append("files        " + (", ".join(f"{k} {_count(v['files'])} ({human_bytes(v['bytes'])})"
                                              for k, v in d["by_status"].items()) or "none"))
    lines.append("actions      " + (", ".join(f"{k} {_count(v['blocks'])}" for k, v in d["by_action"].items())
                                    or "none"))
    return lines


def _store_lines(e: ExplainStore) -> list[str]:
    """A Mooncake store (and deployment): backends, client roots and locks, the writer's
    release with its evidence, what the next client start deletes, objects by status and
    action, and what each prune class could take."""
    s, d = e["store"], e["deployment"]
    lines = [f"store        {s['store']} ({', '.join(s['backends']) or 'no backend'}); client roots "
             f"{', '.join(s['client_roots']) or 'none'}",
             f"locks        {lock_label(s)}",
             f"largest id   {_value(s['largest_bucket_id'])}",
             f"release      {s['writer_release'] or 'unknown'} ({s['writer_release_evidence']})",
             "start        " + (", ".join(f"deletes {_count(c['files'])} {k} ({human_bytes(c['bytes'])})"
                                          for k, c in s["start_deletes"].items()) or "deletes nothing")
             + (f"; {_count(s['start_refuses']['files'])} KVEntry files stop it" if s["start_refuses"]["files"]
                else "")]
    if d is None:
        lines.append("deployments  " + (", ".join(x["deployment"] for x in s["deployments"]) or "none"))
        reclaim = s["reclaimable"]
    else:
        lines += [f"deployment   {d['engine']} {d['scheme']}, model {d['model']}, key ranks {d['key_ranks']}"
                  f" (writer TP {_value(d['writer_tp'])}), kind {_value(d['kv_kind'])}",
                  f"target keys  {_value(d['target'])} ({_value(d['target_profile'])})",
                  f"objects      {_count(d['objects'])} ({human_bytes(d['object_bytes'])}; KVEntry files "
                  f"{_count(d['files'])}, {human_bytes(d['bytes'])} on disk)",
                  "  by status  " + (", ".join(f"{k} {_count(v['objects'])}" for k, v in d["by_status"].items())
                                     or "none"),
                  "  by action  " + (", ".join(f"{k} {_count(v['objects'])}" for k, v in d["by_action"].items())
                                     or "none")]
        reclaim = d["reclaimable"]
    lines.append("reclaimable  " + ", ".join(
        f"{CLASSES[c]} {_count(v['files'])} files ({human_bytes(v['bytes'])}), {_count(v['objects'])} objects"
        + (f" ({human_bytes(v['held_bytes'])} held in live pairs)" if v["held_bytes"] else "")
        for c, v in reclaim.items()))
    return lines


def _count(n: int) -> str:
    return f"{n:,}"  # exact: a person compares these with the report's and the plan's


def _value(v: Any) -> str:
    if v is None:
        return "unknown"
    return str(v).lower() if isinstance(v, bool) else str(v)
