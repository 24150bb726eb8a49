"""Findings and "what to do next" hints, derived from a summary (no I/O).

Like restic's check output, every finding ends in the exact command that deals with it:
listing the affected files, re-running with the missing deployment fact, hashing the
replicas, or applying the migration. Leftovers and what the targets already hold are
reclaimed with `kvmigrate prune` (a dry run first; `--apply` moves them into a quarantine
that `kvmigrate restore` undoes), never with a hand-run `rm`.

`findings_and_hints` runs a table of rules (RULES over the summary, NAMESPACE_RULES over
each namespace), each yielding typed findings (kvmigrate.outputs.Finding) and hints. A
missing fact comes as data: the scan records the flag of identity's MissingFactError as
`target_error_flag`, a refusal of stated facts (identity/facts.py: a model config or kind
meant for another model) the flag that stated them as `target_refused_flag`, and rows name
the flags they ask for (`flags_asked`). No message is parsed.
"""

from __future__ import annotations

import glob
import shlex
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

from kvmigrate import families
from kvmigrate.classify import STATUS_BITS, UNREADABLE_STATUSES
from kvmigrate.identity.facts import _INT_FACTS, FLAGS
from kvmigrate.identity.values import DEFAULT_PROFILE, ORPHANED
from kvmigrate.report import stores as sr
from kvmigrate.report import tiers as tr
from kvmigrate.selection import Selection
from kvmigrate.units import human_bytes, plural

if TYPE_CHECKING:  # the JSON models are types only (kvmigrate.outputs)
    from kvmigrate.outputs import (
        FileCount,
        Finding,
        Hint,
        Namespace,
        Reclaimable,
        ReportOutput,
        Run,
        Store,
        StoreDeployment,
        SummaryCore,
        Tier,
        TierDeployment,
    )

DEFAULT_MANIFEST = "kvmigrate-manifest.parquet"

# what follows for a namespace whose identity is broken; the hint is the exact identity command
IDENTITY_WHY = "never migrated; `kvmigrate identity` on its config.json shows why"
# what follows for a block with a rank file missing depends on the engine that reads it (advice())
INCOMPLETE = "never migrated"
# status -> (what it is, what follows, how to act: "list" | "identity" | "prune" | "rerun")
STATUS_ADVICE: dict[str, tuple[str, str, str]] = {
    "incomplete": ("blocks with a rank file missing", INCOMPLETE, "list"),  # what follows: the family's
    "replica_mismatch": ("replicas that must be equal differ", "never migrated; inspect the listed files", "list"),
    "size_mismatch": ("files whose size differs from their (namespace, group) or the proven geometry",
                      "never migrated; inspect the listed files", "list"),
    "padded_legacy": ("llm-d files longer than their proven data (pre-2026-06-04 16 MiB floor)",
                      "inspect the listed files", "list"),
    "short": ("empty files or files shorter than a header (crash residue)",
              "never migrated; the engine deletes them on read", "list"),
    "zero_filled": ("all-zero files (crash residue)", "never migrated; the engine would serve zeros", "list"),
    "misfiled": ("files whose fan-out folders do not match their name", "never migrated", "list"),
    "header_invalid": ("vllm.cpp files whose header check fails", "never migrated; vllm.cpp deletes them on load",
                       "list"),
    "silent_change": ("files whose bytes changed although size, mtime, ctime and inode did not (found by "
                      "--recheck)", "never migrated; suspect disk or filesystem corruption: check the device "
                      "(smartctl, the filesystem's scrub) and restore or remove the listed files", "list"),
    "unreadable": ("files that could not be read (I/O or permission error)",
                   "fix the permissions or the disk, then audit again", "list"),
    "tmp_leftover": ("temp files of interrupted engine writes",
                     "never reused; prune moves those older than an hour into the quarantine", "prune"),
    "foreign": ("files that are not part of the cache (incl. symlinks, FIFOs, devices)",
                "kvmigrate ignores them", "list"),
    "orphan_namespace": ("rank folders without their base folder or config.json",
                         "never migrated: restore the base folder's config.json, or prune the rank folder",
                         "prune"),
    "digest_mismatch": ("files of a namespace (its config.json and blocks) whose config.json does not hash to its "
                        "folder name", IDENTITY_WHY, "identity"),
    "config_invalid": ("files of a namespace (its config.json and blocks) whose config.json is unreadable, not JSON, "
                       "or of wrong types", IDENTITY_WHY, "identity"),
    "unsupported_layout": ("recognised but out of scope (old llm-d deep tree, pipeline stage)",
                           "kvmigrate does not migrate it", "list"),
    "missing_slots": ("rows of a multi-node engine (--nnodes > 1: a TP/PP/PCP group across nodes), full-size but "
                      "without the remote ranks' slots (vllm#54415)",
                      "never migrated: they serve wrong KV to any reader; vLLM 0.34 refuses such deployments",
                      "prune"),
    "index_lost": ("LMCache local_disk chunks: no restarted engine re-indexes them, whatever their name",
                   "never reused in place; the bytes stay on disk until removed (a leak while no engine indexes "
                   "them): once no engine uses the tier, prune --index-lost --engine-stopped moves them into the "
                   "quarantine", "list"),
    "stale_hash_recipe": ("LMCache chunks keyed by a chunk-hash recipe the target does not compute",
                          "never reused: the hash is one-way, no rename makes them reachable; prune "
                          "--unreadable-namespaces takes a deployment all of whose chunks are so", "list"),
    "unreproducible_hash": ("LMCache chunks whose writer seeded its hash chain at random",
                            "never reused: no process can regenerate their keys; prune --unreadable-namespaces takes "
                            "a deployment all of whose chunks are so", "list"),
    "orphan_data": ("LMCache GDS data files without a whole sidecar (never indexed or probed)",
                    "never reused; prune --residue moves a quiet tier's into the quarantine (a GDS pair together)",
                    "prune"),
    "corrupt_sidecar": ("LMCache GDS sidecars that do not parse or differ from their data header",
                        "never reused; the startup scan of their folder stops there; prune --residue moves a quiet "
                        "tier's into the quarantine with their data files", "prune"),
    "orphan_index": ("indexes without their data file: the objects they list are gone",
                     "never reused; the next start of their engine deletes them", "list"),
}

UNKNOWN_STATE = ("files in an unknown state", "inspect them", "list")


def advice(status: str, family: str | None = None) -> tuple[str, str, str]:
    """STATUS_ADVICE of a status for a namespace of `family`: an incomplete block's hazard
    is the reading engine's (Family.incomplete_advice: llm-d serves stale KV, SGLang misses
    the page)."""
    own = families.get(family).status_advice(status) if family else None
    if own is None and family and families.get(family).root_layout == "stores":
        own = sr.STATUS_ADVICE.get(status)  # a store's words (report/stores.py)
    if own is not None:  # the family's own words for a status of its files
        return own
    what, then, how = STATUS_ADVICE.get(status, UNKNOWN_STATE)
    if status == "incomplete":
        then = f"{INCOMPLETE}; {families.get(family).incomplete_advice}"
    return what, then, how


# Placeholder values for a fact flag the user must supply.
FLAG_VALUES = {
    "--model-dtype": "<bfloat16|float16>",
    "--cache-dtype": "<raw --kv-cache-dtype, e.g. auto>",
    "--kv-kind": "<full|mla|sliding|hybrid|mamba>",
    "--total-kv-heads": "<N>",
    "--page-bytes": "<bytes>",
    "--tensors-per-layer": "<2>",
    "--family": "<vllm|llmd>",
    "--model-config": "<HF config.json>",
    "--runner": "<v1|v2>",
    "--executor": "<mp|ray|uni>",
    "--nnodes": "<N>",
    "--writer-tp": "<N>",
    "--writer-pp": "<N>",
}
# fact -> where its value is, for hints that ask for it (identity.md §4)
FACT_HELP = {
    "kv_kind": "the model's attention kind: mla when its config.json sets kv_lora_rank, sliding or hybrid by its "
               "layer_types or use_sliding_window: true, else full",
    "total_kv_heads": "num_key_value_heads in the model's config.json, else num_attention_heads",
    "model_dtype": "torch_dtype (or dtype) in the model's config.json",
    "cache_dtype": "the --kv-cache-dtype the writer ran with, usually auto",
    "runner": "v2 only if the writer ran vLLM's V2 model runner",
    "executor": "the writer's --distributed-executor-backend",
    "nnodes": "nodes per data-parallel replica of the writer",
    "per_token_head_quant": "whether the writer quantized KV per token and head",
    "page_bytes": "bytes of one tensor's page for one GPU block on one rank",
    "tensors_per_layer": "2 when K and V are separate tensors",
    "family": "the engine that wrote the folder",
    "writer_tp": "the one TP size that wrote every row of the folder (a vLLM 0.24-0.33 gate folded it to 1); "
                 "state it only if no other TP ever wrote there",
    "writer_pp": "the one PP size that wrote every row of the folder",
}
# the facts --model-config reads from a Hugging Face config.json
MODEL_CONFIG_FACTS = ("kv_kind", "total_kv_heads", "model_dtype")
NEEDS_ACTIONS = ("needs_slice", "needs_concat", "needs_relayout", "needs_reshard")
# Actions that take one rank's file for all ranks: they need the replicas proven equal.
REPLICA_ACTIONS = ("link", "copy_pad", "rewrite_header", "slice")
SEVERITY_ORDER = ("operational", "integrity", "finding", "note")
# hints that ask for deployment facts (a rerun with the flags)
FACT_CODES = {"target_guessed", "target_refused", "orphaned"}


def no_cache_message(root: str, foreign_files: int = 0) -> str:
    """The finding (and the scan's error line) of a root with no cache (manifest.holds_no_cache)."""
    return (f"nothing here: is it mounted? {root} holds no cache: no namespace folder (<model>_<d12>), no "
            "SGLang HiCache page or temp file" + (f", only {plural(foreign_files, 'foreign file')}"
                                                 if foreign_files else "")
            + "; an empty or unmounted volume is an operational error (exit bit 8)")


def severity_of(bits: int) -> str:
    if bits & 8:
        return "operational"
    if bits & 4:
        return "integrity"
    if bits & 1:
        return "finding"
    return "note"


class Commands:
    """Builds the exact commands a hint prints, re-using the scan's root, target and facts."""

    def __init__(self, summary: Mapping[str, Any], verb: str):
        self.root = summary.get("root") or "ROOT"
        self.manifest = summary.get("manifest")
        self.verb = verb
        facts = summary.get("facts") or {}
        args: list[str] = []
        target = summary.get("target_profile")
        if target and target != DEFAULT_PROFILE:
            args += ["--target", target]
        for name, value in sorted((facts.get("flags") or {}).items()):
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + flag[2:])
            elif value is not None:
                args += [flag, str(value)]
        if facts.get("facts_file"):
            args += ["--facts", str(facts["facts_file"])]
        self.facts_only = list(args)  # without the selection
        for step in summary.get("selection") or ():  # a partial scan's rerun stays as partial
            if step.get("by") == "scan":
                args += Selection.of(step.get("only"), step.get("exclude")).args()
        self.fact_args = args
        self.verify = summary.get("verify")

    def _join(self, *parts: str) -> str:
        return " ".join(p for p in parts if p)

    def q(self, *words: str) -> str:
        return " ".join(shlex.quote(w) for w in words)

    def rerun(self, *extra: str, replace_flags: tuple[str, ...] = ()) -> str:
        """The scan (or audit) again, with the same settings plus `extra` flags."""
        args = list(self.fact_args)
        for flag in replace_flags:  # drop a flag the hint sets again
            while flag in args:
                i = args.index(flag)
                del args[i:i + 2]
        if self.verify == "hash" and "--verify" not in extra:
            args += ["--verify", "hash"]
        tail = " ".join(extra)
        out: list[str] = []
        if self.manifest:
            out = ["-o" if self.verb == "scan" else "--manifest-out", self.manifest]
        return self._join(f"kvmigrate {self.verb}", self.q(self.root, *args), tail, self.q(*out))

    def list_files(self, status: str, *extra: str) -> str:
        if self.manifest:
            return self._join("kvmigrate report", self.q(self.manifest), f"--list {status}", *extra)
        return self.scan_then(f"kvmigrate report {DEFAULT_MANIFEST} --list {status}", *extra)

    def scan_then(self, *then: str) -> str:
        """A scan of ROOT into DEFAULT_MANIFEST, then `then` on it. Not `&&`: a scan that finds
        something exits 1 or 5, the very case the hint is for; a scan that fails writes no
        manifest, and the old one is removed first, so `then` never reads a stale one."""
        return self._join(f"rm -f {DEFAULT_MANIFEST}; kvmigrate scan", self.q(self.root, *self.fact_args),
                          f"-o {DEFAULT_MANIFEST};", *then)

    def migrate(self, *extra: str) -> str:
        if self.manifest:
            return self._join("kvmigrate migrate --manifest", self.q(self.manifest), *extra)
        return self._join("kvmigrate migrate", self.q(self.root, *self.fact_args), *extra)

    def convert_tier(self) -> str:
        """The migrate that converts local_disk tiers into fs tiers under a new DIR (lmcache.md §3.5)."""
        stated = "--target-backend" in self.fact_args  # (the scan's own flags may state it already)
        return self._join("kvmigrate migrate", self.q(self.root, *self.fact_args),
                          "--dest <DIR>" if stated else "--target-backend fs --dest <DIR>")

    def prune(self, *extra: str, only: list[str] | None = None) -> str:
        """The prune dry run of the root (its own scan, with the same target and facts).
        `only`: of exactly these namespaces (each named by its base folder, glob-escaped),
        instead of the scan's own --only/--exclude."""
        if only is None:
            return self._join("kvmigrate prune", self.q(self.root, *self.fact_args), *extra)
        names = [a for base in only for a in ("--only", glob.escape(base))]
        return self._join("kvmigrate prune", self.q(self.root, *self.facts_only), *extra, self.q(*names))

    def facts_skeleton(self) -> str:
        """`kvmigrate facts` of the root with the facts given so far (the skeleton keeps them)."""
        args, skip = [], False
        for a in self.fact_args:  # (without --only/--exclude: the skeleton covers the root)
            if skip or a in ("--only", "--exclude"):
                skip = not skip
                continue
            args.append(a)
        return self._join("kvmigrate facts", self.q(self.root, *args), "-o FACTS.json")

    def identity(self, base: str) -> str:
        return self._join("kvmigrate identity", self.q(f"{self.root.rstrip('/')}/{base}/config.json"))


def _finding(code: str, bits: int, namespace: str | None, message: str, *, files: int | None = None,
             bytes: int | None = None, blocks: int | None = None, example: str | None = None,
             example_reason: str | None = None) -> Finding:
    """A finding with the keys every finding has; a rule adds the keys of its kind after."""
    return {"code": code, "severity": severity_of(bits), "bits": bits, "namespace": namespace, "message": message,
            "files": files, "bytes": bytes, "blocks": blocks, "example": example, "example_reason": example_reason}


def _files(n: int) -> str:
    return plural(n, "file")


def fact_flag(fact: str) -> str:
    return FLAGS.get(fact, "--" + fact.replace("_", "-"))


def ask_facts(facts: list[str], base: str | None) -> str:
    """Why-text of a hint that asks for facts: each flag with where its value is found, the
    --model-config shortcut, and the FACTS.json entry that states them for one namespace."""
    text = "state " + "; ".join(f"{fact_flag(f)} ({FACT_HELP.get(f, f)})" for f in facts)
    if all(f in MODEL_CONFIG_FACTS for f in facts):
        text += ("; or --model-config PATH (the model's Hugging Face config.json) reads "
                 + ("them" if len(facts) > 1 else "it"))
    values = []
    for f in facts:
        value = FLAG_VALUES.get(fact_flag(f), "<value>")
        values.append(f'"{f}": ' + (value if f in _INT_FACTS else f'"{value}"'))
    return text + f"; or per namespace in --facts FACTS.json: {{\"{base or '*'}\": {{{', '.join(values)}}}}}"


def guessed_targets(namespaces: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Source base -> the facts not given on which its target depends, from manifest
    metadata (`namespaces`): a migration there is a guess until they are stated."""
    return {base: list(t["missing_facts"]) for base, meta in namespaces.items()
            if (t := meta.get("target") or {}).get("missing_facts") and not t.get("unreachable")}


def target_orphaned(n: Namespace) -> bool:
    """A namespace with blocks that the target profile reads only under the name of the
    topology that wrote it, which neither the folder nor the facts say (identity.md §4.1)."""
    return bool(n["blocks"]) and str(n["target_unreachable"] or "").startswith(ORPHANED)


def target_is_guess(n: Namespace) -> bool:
    """A summary namespace plans blocks into a target that depends on facts not given."""
    return bool(n["target_missing_facts"] and not n["target_unreachable"]
                and any(c["blocks"] for a, c in n["by_action"].items() if a != "none"))


def fact_hint(cmd: Commands, facts: list[str], base: str | None) -> tuple[str, str]:
    """(command, why) of the re-run that states `facts` (placeholders for their values)."""
    flags = [fact_flag(f) for f in facts]
    extra: list[str] = []
    for flag in flags:
        extra += [flag, FLAG_VALUES.get(flag, "<value>")]
    return cmd.rerun(*extra, replace_flags=tuple(flags)), ask_facts(facts, base)


def refused_flag(n: Namespace) -> str | None:
    """The flag that would give a refused namespace its target: the missing fact's flag
    as the scan recorded it from the error (identity's MissingFactError: the manifest's
    `target_error_flag`); else the flag that stated refused facts (a model config or a kind
    given for several models, identity/facts.py: `target_refused_flag`); else the family's own."""
    flag = n["target_error_flag"] or n["target_refused_flag"]
    if flag:
        return flag
    return families.get(n["family"]).settled_by if n["family"] else None


# --- the rules -------------------------------------------------------------------------------
#
# Each rule yields typed findings and hints (`_Hint`: a command to merge with the others
# that print it). RULES run in order over the summary, NAMESPACE_RULES in order for each
# namespace; the order is the report's (findings are then sorted by severity and hints by
# rank, both stably). `_State` carries what later rules read of earlier ones.


class _Hint(NamedTuple):
    command: str
    why: str  # kept from the first rule that names the command
    code: str
    namespace: str | None
    rank: int  # 0 first; kept from the first rule that names the command


Item: TypeAlias = "Finding | _Hint"


@dataclass
class _State:
    summary: SummaryCore
    cmd: Commands
    verb: str
    examples: dict[tuple, tuple[str, str | None]]
    unreadable: list[tuple[str, str | None, str]] = field(default_factory=list)  # (status, namespace, what)
    guessed: dict[str, int] = field(default_factory=dict)  # namespace -> pending blocks, of a guessed target
    unproven: int = 0  # pending blocks taken from rank 0 of replicas this scan compared by size only
    deployments: dict[str, int] = field(default_factory=dict)  # deployment -> its namespaces


def _status_findings(st: _State) -> Iterator[Item]:
    """Every status but ok and own_artifact, per namespace (and outside any): a finding
    with an example, and the hint its advice names."""
    cmd, summary = st.cmd, st.summary
    entries: list[tuple[str | None, dict[str, FileCount], str | None]] = [
        (n["source_base"], n["by_status"], n["family"]) for n in summary["namespaces"]]
    outside = summary["outside_namespaces"]
    if outside:
        entries.append((None, outside["by_status"], None))
    for base, by_status, family in entries:
        for status, counts in by_status.items():
            if status in ("ok", "own_artifact"):
                continue
            what, then, how = advice(status, family)
            if base is None and status == "tmp_leftover" and outside and outside["families"]:  # a flat directory's
                what += " (" + ", ".join(families.get(f).title for f in outside["families"]) + ")"
            bits = STATUS_BITS.get(status, 1)
            ex = st.examples.get((base, status), (None, None))
            f = _finding(status, bits, base, f"{_files(counts['files'])}: {what}; {then}", files=counts["files"],
                         bytes=counts["bytes"], example=ex[0], example_reason=ex[1])
            f["status"] = status
            yield f
            rank = 0 if bits & 12 else 1
            if how == "identity" and base is not None:
                yield _Hint(cmd.identity(base), f"{what}: see the recorded and the computed identity", status, base,
                            rank)
            elif how == "prune" and status in UNREADABLE_STATUSES:
                st.unreadable.append((status, base, what))
            elif how == "prune":
                yield _Hint(cmd.prune("--residue"), f"{what}: see what prune would move (dry run), then add --apply; "
                            f"a namespace written in the last 10 minutes is skipped; `kvmigrate restore` undoes it",
                            status, base, 3)
            else:
                yield _Hint(cmd.list_files(status), f"{what}: list them ({then})", status, base, rank)
            if status == "unreadable":
                yield _Hint(cmd.rerun(), "after fixing the permissions or the disk, audit again", status, base, 2)


def _unreadable_namespaces(st: _State) -> Iterator[Item]:
    """One prune command taking exactly the folders its hint names (--unreadable-namespaces
    alone takes every unreadable namespace of the root); never a target: prune keeps those."""
    cmd = st.cmd
    targets = {n["target_base"] for n in st.summary["namespaces"] if n["target_base"]}
    take = sorted({base for _, base, _ in st.unreadable if base is not None and base not in targets})
    for status, base, what in st.unreadable:
        if base in take:
            yield _Hint(cmd.prune("--unreadable-namespaces", only=take), f"{what}: see what prune would move (dry "
                        "run), then add --apply; a namespace written in the last 10 minutes is skipped; `kvmigrate "
                        "restore` undoes it", status, base, 3)
        else:
            yield _Hint(cmd.list_files(status), f"{what}, of a target namespace (prune never takes a target's "
                        "files): list them", status, base, 1)


def _reclaimable(st: _State) -> Iterator[Item]:
    """Legacy blocks already in their target: prune reclaims them."""
    for n in st.summary["namespaces"]:
        placed = n["by_action"].get("already_present")
        if placed and placed["blocks"] and n["target_base"] and n["target_base"] != n["source_base"]:
            yield _Hint(st.cmd.prune(), f"{plural(placed['blocks'], 'legacy block file')} "
                        f"({human_bytes(placed['bytes'])}) already in their target: the engine's evictors count both "
                        "names; see what prune reclaims (dry run), then add --apply", "reclaimable", n["source_base"], 3)


def _namespace_status(st: _State, n: Namespace) -> Iterator[Item]:
    """A namespace-level status none of its files carries (its config.json is broken...)."""
    status = n["status"]
    if status in (None, "ok") or status in n["by_status"]:
        return
    what, then, how = (advice(status, n["family"]) if status in STATUS_ADVICE
                       else ("a namespace in an unknown state", "inspect it", "list"))
    f = _finding(status, STATUS_BITS.get(status, 1), n["source_base"], f"namespace: {what}; {then}",
                 example_reason=n["status_reason"] or n["config_error"])
    f["status"] = status
    yield f
    if how == "identity":
        yield _Hint(st.cmd.identity(n["source_base"]), f"{what}: see the recorded and the computed identity", status,
                    n["source_base"], 0)


def _target_refused(st: _State, n: Namespace) -> Iterator[Item]:
    """No target: the rerun that states the missing fact."""
    error = n["target_error"]
    if not error:
        return
    base = n["source_base"]
    flag = refused_flag(n)
    f = _finding("target_refused", 1, base, f"no target namespace: {error.splitlines()[0]}", blocks=n["blocks"],
                 bytes=n["block_bytes"])
    f["flag"] = flag
    yield f
    if flag:
        fact = next((f for f, fl in FLAGS.items() if fl == flag), None)
        why = (ask_facts([fact], base) if fact in FACT_HELP
               else f"state the missing fact ({flag}; or per namespace in --facts FACTS.json)")
        yield _Hint(st.cmd.rerun(flag, FLAG_VALUES.get(flag, "<value>"), replace_flags=(flag,)), why, "target_refused",
                    base, 2)


def _target_guessed(st: _State, n: Namespace) -> Iterator[Item]:
    """A target that depends on facts not given: state them (no migrate command until then)."""
    if not target_is_guess(n):
        return
    base = n["source_base"]
    st.guessed[base] = n["pending"]["blocks"]
    missing = n["target_missing_facts"]
    planned = {a: c for a, c in n["by_action"].items() if a != "none"}
    blocks = sum(c["blocks"] for c in planned.values())
    f = _finding("target_guessed", 1, base,
                 f"target {n['target_base']} is a guess: it depends on {', '.join(fact_flag(f) for f in missing)}, "
                 f"not given; {plural(blocks, 'block')} {'is' if blocks == 1 else 'are'} planned there, where the "
                 "target engine may never read them", blocks=blocks, bytes=sum(c["bytes"] for c in planned.values()))
    f["facts"] = missing
    yield f
    command, why = fact_hint(st.cmd, missing, base)
    yield _Hint(command, f"{why}; then {st.verb} again", "target_guessed", base, 1)


def _family_harmless(st: _State, n: Namespace) -> Iterator[Item]:
    """An ambiguous family whose readings agree: a note."""
    settled_by = families.get(n["family"]).settled_by  # the ambiguous reading: --family
    if not settled_by or n["target_error"]:
        return
    if sum(f.get(settled_by, 0) for f in n["flags_asked"].values()):
        return
    f = _finding("family_ambiguous", 0, n["source_base"], "S1 folder could be vllm or llm-d; both readings give "
                 "the same bytes here, so the ambiguity changes no decision")
    f["evidence"] = n["family_evidence"]
    yield f


def _needs_transforms(st: _State, n: Namespace) -> Iterator[Item]:
    """Blocks that need a transform: proven, or waiting for facts."""
    asked = n["flags_asked"]
    for action in NEEDS_ACTIONS:
        count = n["by_action"].get(action)
        if not count:
            continue
        reasons = [r for r, _ in n["top_reasons"].get(action, [])]
        waits = not asked.get(action)
        yield _finding(
            action, 0, n["source_base"],
            f"{plural(count['blocks'], 'block')} need{'s' if count['blocks'] == 1 else ''} the "
            f"{action.removeprefix('needs_')} transform"
            + (" but their numbers are not proven (migrate --apply skips them; the reason says why)" if waits else
               f" and the facts {', '.join(sorted(asked[action]))}")
            + (f"; e.g. {reasons[0]}" if reasons else ""),
            blocks=count["blocks"], bytes=count["bytes"])


def _flags_asked(st: _State, n: Namespace) -> Iterator[Item]:
    """The flags the rows' reasons ask for (findings.asks), per action: the rerun with them."""
    cmd, base = st.cmd, n["source_base"]
    for action, flags in sorted(n["flags_asked"].items()):
        blocks = max(flags.values())
        if action == "none" and "--family" in flags:
            f = _finding("family_ambiguous", 1, base, "S1 folder could be vllm or llm-d and the two readings give "
                         f"different bytes: {plural(blocks, 'file')} stay{'s' if blocks == 1 else ''} unmigrated "
                         "until the family is given", files=blocks)
            f["evidence"] = n["family_evidence"]
            yield f
        elif action == "none" and set(flags) != {n["target_error_flag"]}:
            yield _finding("fact_needed", 0, base, f"{plural(blocks, 'file')} need{'s' if blocks == 1 else ''} "
                           f"{', '.join(sorted(flags))} to be planned")
        extra: list[str] = []
        for flag in sorted(flags):
            extra += [flag, FLAG_VALUES.get(flag, "<value>")]
        why = ("say which engine wrote it (--family; or per namespace in --facts FACTS.json)" if "--family" in flags
               else f"state {', '.join(sorted(flags))}: the verdicts of {plural(blocks, 'file')} wait for them"
               if action == "none" else f"state {', '.join(sorted(flags))} so {action} can be planned")
        yield _Hint(cmd.rerun(*extra, replace_flags=tuple(sorted(flags))), why,
                    "family_ambiguous" if "--family" in flags else action, base, 2)
        if action == "needs_slice" and cmd.verify != "hash":  # the other way its reason names
            yield _Hint(cmd.rerun("--verify", "hash"), "or let the rows prove the slice's cell size: a hashing scan "
                        "finds the one size giving N equal cells (`kvmigrate migrate ROOT` scans so)", action, base, 2)


def _aliases_source(st: _State, n: Namespace) -> Iterator[Item]:
    """Target paths that are source paths of other bytes: another root."""
    aliased, base = n["aliases_source_blocks"], n["source_base"]
    if not aliased:
        return
    yield _finding("aliases_source", 0, base, f"{plural(aliased, 'block')}: the target path equals a source path "
                   "holding other bytes", blocks=aliased)
    if base not in st.guessed:
        yield _Hint(st.cmd.migrate("--dest", "<DIR>", "--apply"),
                    "put the target namespace under another root (same filesystem for links)", "aliases_source", base,
                    4)


def _relayout_dest(st: _State, n: Namespace) -> Iterator[Item]:
    """A flat family's relayout writes into a new storage directory."""
    relayout = n["by_action"].get("relayout")
    if relayout and relayout["blocks"] and families.get(n["family"]).root_layout == "flat":
        yield _Hint(st.cmd.migrate("--dest", "<DIR>", "--apply"), "a relayout keeps the page's file name: it is "
                    "written into a new storage directory DIR (with links to the pages kept as they are), never over a "
                    "source", "relayout", n["source_base"], 4)


def _replicas_unverified(st: _State, n: Namespace) -> Iterator[Item]:
    """Blocks taken from rank 0 of replicas a size scan did not compare: hash them."""
    multi_rank = len(n["ranks"]) > 1 or st.deployments.get(n["deployment"] or "", 0) > 1
    relies = sum(n["by_action"][a]["blocks"] for a in REPLICA_ACTIONS if a in n["by_action"])
    verify = st.summary["verify"]
    if not (multi_rank and verify != "hash" and relies):
        return
    st.unproven += relies
    yield _finding("replicas_unverified", 0, n["source_base"],
                   f"{plural(relies, 'block')} would be taken from rank 0 of replicas compared by size "
                   f"only (verify={verify}): differing replicas are not detected until hashed", blocks=relies)
    yield _Hint(st.cmd.rerun("--verify", "hash"), "hash every replica: it names the blocks whose replicas differ "
                "(replica_mismatch, never migrated) and shows which pending blocks a migration can place",
                "replicas_unverified", n["source_base"], 3)


def _hash_lengths(st: _State, n: Namespace) -> Iterator[Item]:
    if len(n["hash_bytes"]) > 1:
        yield _finding("hash_lengths", 0, n["source_base"], "several block-hash lengths in one namespace: "
                       + ", ".join(f"{b * 2} hex" for b in n["hash_bytes"]))


def _notes(st: _State, n: Namespace) -> Iterator[Item]:
    for note in n["notes"]:
        yield _finding("note", 0, n["source_base"], note)


def _unreachable(st: _State, n: Namespace) -> Iterator[Item]:
    """A target the profile reads only under the writer's topology (orphaned: state it), or
    no block reusable at all."""
    base = n["source_base"]
    if target_orphaned(n):
        yield _finding("orphaned", 1, base, f"{plural(n['blocks'], 'block')} ({human_bytes(n['block_bytes'])}) "
                       f"{n['target_unreachable']}", blocks=n["blocks"], bytes=n["block_bytes"])
        command, why = fact_hint(st.cmd, ["writer_tp", "writer_pp"], base)
        yield _Hint(command, f"{why}; then {st.verb} again (no migrate command until then)", "orphaned", base, 1)
    elif n["target_unreachable"]:
        yield _finding("unreachable", 0, base, f"no block can be reused: {n['target_unreachable']}")


def _claims(st: _State, n: Namespace) -> Iterator[Item]:
    for claim in n["claims"]:
        yield _finding("claim", 0, n["source_base"], claim)


def _assumed_facts(st: _State, n: Namespace) -> Iterator[Item]:
    assumed = n["assumed_facts"]
    if not assumed:
        return
    facts = ", ".join(f"{k}={v}" for k, v in sorted(assumed.items()))
    decisive = n["target_decisive_assumptions"]
    if decisive:
        facts += ("; the target rests on " + ", ".join(f"{k}={v}" for k, v in sorted(decisive.items()))
                  + " (state " + ", ".join(fact_flag(k) for k in sorted(decisive))
                  + " if the writer did not run with these defaults)")
    f = _finding("assumed_facts", 0, n["source_base"], f"assumed (not given): {facts}")
    f["assumed"] = assumed
    yield f


NAMESPACE_RULES: tuple[Callable[[_State, Namespace], Iterator[Item]], ...] = (
    _namespace_status, _target_refused, _target_guessed, _family_harmless, _needs_transforms, _flags_asked,
    _aliases_source, _relayout_dest, _replicas_unverified, _hash_lengths, _notes, _unreachable, _claims,
    _assumed_facts,
)


def _each_namespace(st: _State) -> Iterator[Item]:
    for n in st.summary["namespaces"]:
        if n["deployment"]:
            st.deployments[n["deployment"]] = st.deployments.get(n["deployment"], 0) + 1
    for n in st.summary["namespaces"]:
        for rule in NAMESPACE_RULES:
            yield from rule(st, n)


def _walk_errors(st: _State) -> Iterator[Item]:
    summary = st.summary
    if summary["walk_failed"] or summary["walk_errors"]:
        errors = summary["walk_errors"]
        yield _finding("walk_errors", 8, None, f"the walk could not read {plural(len(errors), 'path')}"
                       + (f"; first: {errors[0]}" if errors else ""), files=len(errors))
        yield _Hint(st.cmd.rerun(), f"fix the permissions or I/O errors under {st.cmd.root}, then scan again",
                    "walk_errors", None, 0)


def _no_cache(st: _State) -> Iterator[Item]:
    """Nothing here (exit bit 8), or no namespace among what is."""
    cmd = st.cmd
    if st.summary["no_cache"]:
        outside = st.summary["outside_namespaces"]
        foreign = outside["by_status"].get("foreign") if outside else None
        yield _finding("no_cache", 8, None, no_cache_message(cmd.root, foreign["files"] if foreign else 0))
        yield _Hint(f"findmnt --target {shlex.quote(cmd.root)}", f"nothing here: is {cmd.root} mounted? see which "
                    f"filesystem holds it; mount the cache volume there (or pass the engine's cache root_dir), then "
                    f"{st.verb} again", "no_cache", None, 0)
    elif not st.summary["namespaces"]:
        yield _finding("no_namespaces", 0, None, f"no cache namespace (<model>_<d12> folder) under {cmd.root}: is it "
                       "the engine's cache root_dir?")


def _migration_pending(st: _State) -> Iterator[Item]:
    """Reusable blocks not yet in their targets: migrate them (unless a target is a guess)."""
    summary, unproven = st.summary, st.unproven
    pending = summary["totals"]["pending"]
    if not pending["blocks"]:
        return
    guessed_pending = sum(st.guessed.values())
    message = (f"{plural(pending['blocks'], 'reusable block')} {'is' if pending['blocks'] == 1 else 'are'} "
               "not yet in their target namespaces")
    if summary["verify"] != "hash":  # reusable by name and size only: nobody read them yet
        message += (f" (judged by size: this scan (--verify {summary['verify']}) did not read them; "
                    "a migration reads and checks each before placing it)")
    if unproven:  # a migration hashes them and refuses differing replicas, which then stay "pending" here
        one = unproven == 1
        message += (f"; {unproven} of them {'is' if one else 'are'} pending only if {'its' if one else 'their'} "
                    "replicas are equal, which this scan did not compare: a migration refuses replicas that "
                    "differ, and blocks it refused stay counted here until a hash audit names them "
                    "replica_mismatch")
    if guessed_pending:
        message += (f"; {guessed_pending} of them go to targets that are a guess: state the facts first "
                    "(no migrate command until then)")
    f = _finding("migration_pending", 1, None, message, blocks=pending["blocks"], bytes=pending["bytes"])
    f["unproven_replicas"] = unproven
    yield f
    # a store whose pending work has no proof that its clients are stopped makes `migrate --apply` exit 2:
    # its own hint (mooncake_apply_proof) names the apply with the proof, for every target at once
    unproven_store = any(store["pending_objects"] and _proof_command(st, store) is not None
                         for store in summary.get("stores") or ())
    if not guessed_pending and not unproven_store:
        why = ("then migrate the blocks whose replicas hash equal (without --apply it prints the plan only; "
               "it refuses differing replicas, so running it again does not place the blocks a migration "
               "already refused)" if unproven == pending["blocks"] else
               "migrate the reusable blocks (without --apply it prints the plan only)")
        assumes = {k: v for n in summary["namespaces"] if n["pending"]["blocks"]
                   for k, v in n["target_decisive_assumptions"].items()}
        if assumes:
            why += ("; the targets assume " + ", ".join(f"{k}={v}" for k, v in sorted(assumes.items()))
                    + " (vLLM's defaults): if the writer ran otherwise, state "
                    + ", ".join(fact_flag(k) for k in sorted(assumes)) + " first")
        yield _Hint(st.cmd.migrate("--apply"), why, "migration_pending", None, 5)


# --- LMCache tiers: §7's notes (report/tiers.py builds the tiers) ------------------------------


def _assumed(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """Every recipe fact the verdicts assumed, with the flags that state it (§3.3)."""
    if not d["assumed_facts"]:
        return
    parts = [f"{a['fact']} assumed {a['value']}: state it with {' and '.join(a['flags'])}"
             for a in d["assumed_facts"]]
    f = _finding(tr.ASSUMED, 0, d["deployment"], "; ".join(parts))
    f["assumed"] = {a["fact"]: a["value"] for a in d["assumed_facts"]}
    yield f


def _local_disk(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """A local_disk tier: its chunks are a leak until converted or removed (§3.5, §6)."""
    lost = d["reclaimable"]["index_lost"]
    if d["backend"] != tr.LOCAL_DISK or not lost["files"]:
        return
    yield _finding(tr.NOTE_LOCAL_DISK, 0, d["deployment"],
                   f"local_disk tier {tier['tier']}: no restarted engine re-indexes its "
                   f"{plural(lost['files'], '.pt file')} ({human_bytes(lost['bytes'])}), whatever their names; "
                   "convert them into a new fs tier with `migrate ROOT --target-backend fs --dest DIR`, or remove "
                   "them with `prune --index-lost` once no engine uses the tier", files=lost["files"],
                   bytes=lost["bytes"])
    yield _Hint(st.cmd.convert_tier(), f"convert local_disk tier {tier['tier']} into an fs tier under DIR "
                "(DIR/<tier>, then configure remote_url: fs://…/DIR/<tier>); without --apply it prints the plan only",
                tr.NOTE_LOCAL_DISK, d["deployment"], 4)
    yield _Hint(st.cmd.prune("--index-lost", "--engine-stopped"), f"or, once no engine uses local_disk tier "
                f"{tier['tier']} (--engine-stopped states it), see what prune would move (dry run), then add --apply",
                tr.NOTE_LOCAL_DISK, d["deployment"], 4)


def _seedless(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """A writer without PYTHONHASHSEED (§3.2: random up to vLLM 0.28, fixed from 0.29 but
    for xxhash)."""
    if d["facts"].get("pythonhashseed") != "unset":
        return
    none = d["writer_none_hash"]
    if none == "random":
        text = ("seedless writer: its chain was seeded at random, no process regenerates its keys "
                "(unreproducible_hash); run writers with a fixed PYTHONHASHSEED")
    elif none == "fixed":
        text = ("seedless writer: NONE_HASH is vLLM's fixed \"vllm-none-hash\" (vLLM 0.29+), reproducible, but "
                "unlike any deployment that sets PYTHONHASHSEED: the target must leave it unset too")
    else:
        text = ("seedless writer: whether its chain is reproducible depends on its vLLM release (random up to 0.28): "
                "state it with --vllm-release")
    yield _finding(tr.NOTE_SEEDLESS, 0, d["deployment"], text)


def _seed_fix(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """Chunks stale by their NONE_HASH alone: the target taking the writer's seed reaches them."""
    n = d["seed_fix_files"]
    seed = d["facts"].get("pythonhashseed")
    if not n or seed is None:
        return
    yield _finding(tr.NOTE_SEED_FIX, 0, d["deployment"],
                   f"PYTHONHASHSEED differs: start the target with PYTHONHASHSEED={seed} (the writer's) and these "
                   f"{plural(n, 'chunk file')} are reachable again (--target-pythonhashseed states the target's)",
                   files=n)
    flag = "--target-pythonhashseed"
    # (hints merge by command: the why speaks for every deployment of this writer seed)
    yield _Hint(st.cmd.rerun(flag, str(seed), replace_flags=(flag,)), f"with the target started under "
                f"PYTHONHASHSEED={seed}: {st.verb} again to see them reachable (deployments of other seeds: one "
                f"--facts FACTS.json entry each, {{\"<tier>:<model>\": {{\"target_pythonhashseed\": "
                f"\"{seed}\"}}}})", tr.NOTE_SEED_FIX, d["deployment"], 2)


def _corrupt_sidecar(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """A corrupt GDS sidecar stops the startup scan of its folder, not the server (R2 §3.1)."""
    c = d["by_status"].get("corrupt_sidecar")
    if not c:
        return
    yield _finding(tr.NOTE_CORRUPT_SIDECAR, 0, d["deployment"],
                   f"{plural(c['files'], 'corrupt GDS sidecar')} in tier {tier['tier']}: the startup scan of each "
                   "one's <2> folder stops there (logged; the server still starts and lookups still probe each key's "
                   "sidecar); its data file is orphan_data", files=c["files"], bytes=c["bytes"])


def _zero_hex64(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """64-hex fs names starting with 0: the internal API's from_string drops the zero (R2 §3.5)."""
    n = d["zero_hex64_files"]
    if not n:
        return
    yield _finding(tr.NOTE_ZERO_HEX64, 0, d["deployment"],
                   f"{plural(n, 'fs chunk name')} with a 64-hex hash starting with 0: /cache/load-fs-chunks cannot "
                   "load them (CacheEngineKey.from_string drops the leading zero, so it opens a name that does not "
                   "exist)", files=n)


def _rc2_in_tree(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """Target lmcache-0.5.7rc2 for an in-process deployment: vLLM's in-tree connector
    imports the adapter 0.5.7rc2 moved (R2 §1)."""
    if d["target_profile"] != tr.RC2 or d["backend"] == tr.MP:
        return
    yield _finding(tr.NOTE_RC2_IN_TREE, 0, d["deployment"],
                   f"target {tr.RC2} under vLLM's in-tree LMCacheConnectorV1 (vLLM 0.34 included): it imports "
                   "lmcache.integration.vllm.vllm_v1_adapter, which 0.5.7rc2 moved, so the engine fails at start "
                   "(ImportError) and reads nothing; the names and bytes are 0.5.6's: stay on lmcache-0.5.6 until "
                   "vLLM's connector follows")


def _fs_native(st: _State, tier: Tier, d: TierDeployment) -> Iterator[Item]:
    """MP tiers: the fs_native adapter's usage restarts at 0 after a restart (R2 §2)."""
    if d["backend"] != tr.MP or not d["files"]:
        return
    yield _finding(tr.NOTE_FS_NATIVE, 0, d["deployment"],
                   f"MP tier {tier['tier']}: after a server restart the fs_native L2 adapter counts its usage from 0, "
                   f"not the {plural(d['files'], 'file')} ({human_bytes(d['bytes'])}) already here (LMCache #4564): "
                   "eviction starts late and the disk can fill; leave that much room below max_capacity",
                   files=d["files"], bytes=d["bytes"])


TIER_RULES: tuple[Callable[[_State, Tier, TierDeployment], Iterator[Item]], ...] = (
    _assumed, _local_disk, _seedless, _seed_fix, _corrupt_sidecar, _zero_hex64, _rc2_in_tree, _fs_native,
)


def _each_tier(st: _State) -> Iterator[Item]:
    """The notes of every LMCache tier deployment (lmcache.md §7)."""
    for tier in st.summary.get("tiers") or ():
        for d in tier["deployments"]:
            for rule in TIER_RULES:
                yield from rule(st, tier, d)


# --- Mooncake stores: §7's notes (report/stores.py builds the stores) ------------------------


def _store_family(st: _State, store: Store) -> families.Family | None:
    fam = next((n["family"] for n in st.summary["namespaces"] if n["source_base"] == store["namespace"]), None)
    return families.get(fam) if fam else None


def _explain(cmd: Commands, label: str) -> str:
    if cmd.manifest:
        return cmd._join("kvmigrate explain", cmd.q(cmd.manifest, label))
    return cmd.scan_then("kvmigrate explain", cmd.q(DEFAULT_MANIFEST, label))


def _has_work(st: _State, store: Store) -> bool:
    """Pending objects, or (where prune takes the family's files) files or objects a prune
    class could take: an apply would write the store."""
    if store["pending_objects"]:
        return True
    fam = _store_family(st, store)
    return bool(fam is not None and fam.prunes
                and any(v["files"] or v["objects"] for v in store["reclaimable"].values()))


def _proof_command(st: _State, store: Store) -> str | None:
    """The apply command with §5.1's proof (b), when the store has none stated; None: it has one."""
    if store["engine_stopped"] or (sr.release_ok_for_lock(store) and store["backends"] == [sr.BUCKET]):
        return None
    if store["pending_objects"]:
        return st.cmd.migrate("--apply", "--engine-stopped")
    fam = _store_family(st, store)
    return st.cmd.prune("--residue", "--engine-stopped") if fam is not None and fam.prunes else None


def _store_assumed(st: _State, store: Store) -> Iterator[Item]:
    """Every store and deployment fact the report assumed, with the flag that states it (§3.2)."""
    assumed: dict[str, Any] = {}
    parts = []
    if not store["writer_release_stated"]:
        assumed["writer_release"] = store["writer_release"]
        parts.append(f"writer_release assumed {store['writer_release'] or 'unknown'} (from "
                     f"{store['writer_release_evidence']}): state it with --writer-release, or \"writer_release\" "
                     f"under \"{store['store']}\" in --facts FACTS.json")
    if not store["engine_stopped"]:
        assumed["engine_stopped"] = False
        parts.append("engine_stopped assumed false (a client may use the store): state it with --engine-stopped "
                     "once every Mooncake client of the store is stopped")
    for d in store["deployments"]:
        for fact, value in d["assumed_facts"].items():
            assumed[fact] = value
            parts.append(f"{d['deployment']}: {fact} assumed {value}: state it with {fact_flag(fact)}")
    if not parts:
        return
    f = _finding(sr.ASSUMED, 0, store["namespace"], f"store {store['store']}: " + "; ".join(parts))
    f["assumed"] = assumed
    yield f


def _client_live(st: _State, store: Store) -> Iterator[Item]:
    """A held 0.3.14 client lock: a client runs there, an apply exits 8 (§1.4, §5.1)."""
    live = store["client_live"]
    if not live:
        return
    yield _finding(sr.NOTE_CLIENT_LIVE, 0, store["namespace"],
                   f"client live: a Mooncake client holds the lock {M_LOCK} in {', '.join(live)} of store "
                   f"{store['store']}: migrate --apply and prune --apply exit 8 until it stops (stop the clients, "
                   "then apply)")
    yield _Hint(_explain(st.cmd, store["namespace"] or store["store"]), f"store {store['store']}: a client runs in "
                f"{', '.join(live)}; stop it before any apply, and see the store's client roots and locks",
                sr.NOTE_CLIENT_LIVE, store["namespace"], 1)


def _apply_proof(st: _State, store: Store) -> Iterator[Item]:
    """What proof an apply needs that no client runs (§5.1): the client flock of a stated
    >= 0.3.14 bucket store, else --engine-stopped."""
    if not _has_work(st, store):
        return
    name = store["store"]
    if store["engine_stopped"]:
        text = f"store {name}: an apply may write it: engine_stopped is stated (no Mooncake client uses it)"
    elif sr.release_ok_for_lock(store) and store["backends"] == [sr.BUCKET]:
        text = (f"store {name}: an apply takes the client lock {M_LOCK} of each bucket client root it writes "
                f"(writer_release {store['writer_release']} stated): a held one exits 8, nothing written")
    else:
        text = (f"store {name}: an apply writes it only with a proof that no Mooncake client runs there: stop its "
                "clients and pass --engine-stopped (or state engine_stopped for it in --facts)"
                + (f"; or, if its clients run Mooncake 0.3.14, state --writer-release 0.3.14 and kvmigrate takes "
                   f"their client lock {M_LOCK}" if store["backends"] == [sr.BUCKET] else "")
                + "; without a proof the apply exits 2 and writes nothing")
    yield _finding(sr.NOTE_APPLY_PROOF, 0, store["namespace"], text)
    command = _proof_command(st, store)
    if command is not None:
        yield _Hint(command, f"once every Mooncake client of store {name} is stopped (--engine-stopped states it): "
                    "apply; restart the clients and the master afterwards", sr.NOTE_APPLY_PROOF, store["namespace"],
                    5)
        if store["backends"] == [sr.BUCKET] and not store["writer_release_stated"]:
            flag = "--writer-release"
            yield _Hint(st.cmd.rerun(flag, "0.3.14", replace_flags=(flag,)), f"or, if the clients of store {name} "
                        "run Mooncake 0.3.14, state it: the apply then takes their client lock instead",
                        sr.NOTE_APPLY_PROOF, store["namespace"], 5)


def _start_deletes(st: _State, store: Store) -> Iterator[Item]:
    """What the next client start deletes (§1.4): Mooncake's doing, not kvmigrate's."""
    gone = store["start_deletes"]
    if not gone:
        return
    files = sum(c["files"] for c in gone.values())
    nbytes = sum(c["bytes"] for c in gone.values())
    what = {"orphan_data": ".bucket files without a live index", "corrupt_sidecar": "indexes that do not parse or "
            "list nothing (each with its .bucket, counted as orphan_data)", "orphan_index": "indexes whose .bucket "
            "is gone"}
    parts = ", ".join(f"{plural(c['files'], status + ' file')} ({what[status]})" for status, c in gone.items())
    yield _finding(sr.NOTE_START_DELETES, 0, store["namespace"],
                   f"the next Mooncake client start on store {store['store']} deletes {_files(files)} "
                   f"({human_bytes(nbytes)}): {parts}; no read serves them now either; list them (copy away what "
                   "you want to inspect before a client starts)", files=files, bytes=nbytes)
    for status in gone:
        yield _Hint(st.cmd.list_files(status), f"files the next Mooncake client start deletes ({status}): list them",
                    sr.NOTE_START_DELETES, store["namespace"], 1)


def _start_refused(st: _State, store: Store) -> Iterator[Item]:
    """A depth-3 file of the fsdir that is no KVEntry: the client does not start (§1.3)."""
    c = store["start_refuses"]
    if not c["files"]:
        return
    yield _finding(sr.NOTE_START_REFUSED, 0, store["namespace"],
                   f"{_files(c['files'])} at depth 3 of store {store['store']}'s fsdir do not parse as KVEntries: a "
                   "Mooncake client starting there refuses to start (setup() raises) until they are removed; list "
                   "them", files=c["files"], bytes=c["bytes"])
    own = next((n for n in st.summary["namespaces"] if n["source_base"] == store["namespace"]), None)
    for status in sr.START_REFUSES:
        if own is not None and status in own["by_status"]:
            yield _Hint(st.cmd.list_files(status), f"KVEntry files that stop a Mooncake client from starting "
                        f"({status}): list them", sr.NOTE_START_REFUSED, store["namespace"], 0)


def _entry_statuses(st: _State, store: Store, d: StoreDeployment) -> Iterator[Item]:
    """Every status of index entries but ok: a pair file is `ok` while an entry of it is cut,
    zero or a replica that differs (§1.4, §2.4), so the file statuses do not show them."""
    fam = _store_family(st, store)
    for status, c in d["entries_by_status"].items():
        if status == "ok":
            continue
        what, then, _ = advice(status, fam.name if fam is not None else None)
        bits = STATUS_BITS.get(status, 1)
        ex = st.examples.get((d["deployment"], status), (None, None))
        f = _finding(status, bits, d["deployment"], f"{plural(c['objects'], 'index entry', 'index entries')} of live "
                     f"pairs: {what}; {then}", bytes=c["bytes"], example=ex[0], example_reason=ex[1])
        f["status"] = status
        yield f
        yield _Hint(st.cmd.list_files(status), f"{what}: list them ({then})", status, d["deployment"],
                    0 if bits & 12 else 1)


def _unserved(st: _State, store: Store, d: StoreDeployment) -> Iterator[Item]:
    """Keys `is_exist` reports that no read serves (§1.4): cut records, raw keys, misfiled KVEntries."""
    cut, raw, misfiled = d["cut_records"], d["raw_keys"], d["misfiled_entries"]
    if not (cut or raw or misfiled):
        return
    parts = []
    if cut:
        parts.append(f"{plural(cut, 'record')} cut by their .bucket's end (every read fails; prune --tails retires "
                     "their keys)")
    if raw:
        parts.append(f"{plural(raw, 'raw key')} Mooncake >= 0.3.12 registers as tenant default and never reads "
                     "(pending rekey)")
    if misfiled:
        parts.append(f"{plural(misfiled, 'KVEntry', 'KVEntries')} outside fpk(key), never read (migrate links them "
                     "there)")
    yield _finding(sr.NOTE_UNSERVED, 0, d["deployment"], "is_exist reports keys no read serves: " + "; ".join(parts))
    if raw or misfiled:
        yield _Hint(_proof_command(st, store) or st.cmd.migrate("--apply"), "keys is_exist reports but no read "
                    "serves: migrate rekeys and links them (without --apply it prints the plan only)",
                    sr.NOTE_UNSERVED, d["deployment"], 5)
    if cut:
        fam = _store_family(st, store)
        if fam is not None and fam.prunes:
            yield _Hint(st.cmd.prune("--tails"), "cut records of live pairs: see what prune --tails would retire "
                        "(dry run), then add --apply", sr.NOTE_UNSERVED, d["deployment"], 3)
        else:
            yield _Hint(st.cmd.list_files("short"), "cut records of live pairs (is_exist says 1, every read fails): "
                        "list them", sr.NOTE_UNSERVED, d["deployment"], 1)


def _auto_prefix(st: _State, store: Store, d: StoreDeployment) -> Iterator[Item]:
    """vLLM's `auto-` cache prefix changes with every build (§2.2): never renamed."""
    if not d["auto_prefix"]:
        return
    yield _finding(sr.NOTE_AUTO_PREFIX, 0, d["deployment"],
                   f"its keys carry vLLM's cache prefix {d['auto_prefix']}, made from the build, the model and the "
                   "cache config: every other vLLM build computes another prefix and reads none of them (kvmigrate "
                   "never renames across it); give the connector a fixed cache prefix to keep a cache across "
                   f"upgrades ({plural(d['objects'], 'object')} here)")
    yield _Hint(_explain(st.cmd, d["deployment"]), f"deployment {d['deployment']}: its keys and target",
                sr.NOTE_AUTO_PREFIX, d["deployment"], 6)


def _new_pairs(st: _State, store: Store, d: StoreDeployment) -> Iterator[Item]:
    """New pairs get ids above every existing one (§3.6): FIFO evicts them last."""
    if not d["reshard_objects"] or sr.BUCKET not in store["backends"]:
        return
    yield _finding(sr.NOTE_NEW_PAIRS, 0, d["deployment"],
                   f"the migration writes the outputs of {plural(d['reshard_objects'], 'object')} into new pairs "
                   f"with ids above the store's largest ({store['largest_bucket_id']}): Mooncake's FIFO eviction "
                   "(lowest id first) removes them last, after every older pair")
    yield _Hint(st.cmd.migrate(), "see the plan: the new pairs and their ids", sr.NOTE_NEW_PAIRS, d["deployment"], 5)


def _unlocked(st: _State, store: Store) -> Iterator[Item]:
    """Bucket client roots without 0.3.14's lock: two clients on one root clash (§1.4)."""
    if sr.BUCKET not in store["backends"] or any(s != "absent" for s in store["locks"].values()):
        return
    if sr.release_ok_for_lock(store):
        return
    yield _finding(sr.NOTE_UNLOCKED, 0, store["namespace"],
                   f"store {store['store']}: its bucket client roots have no client lock (Mooncake <= 0.3.13 takes "
                   "none): two clients started on one client root in the same second make the same bucket ids and "
                   "truncate each other's pairs (Mooncake #3528); give every client its own ssd_offload_path, or run "
                   "0.3.14, whose lock refuses a second client")
    yield _Hint(_explain(st.cmd, store["namespace"] or store["store"]), f"store {store['store']}: its client roots "
                "and their locks", sr.NOTE_UNLOCKED, store["namespace"], 6)


def _store_is_client(st: _State, store: Store) -> Iterator[Item]:
    """A store folder that is itself a bucket client root above rank client roots (R §5)."""
    if not store["store_is_client_root"]:
        return
    yield _finding(sr.NOTE_STORE_IS_CLIENT, 0, store["namespace"],
                   f"store folder {store['store']} is itself a bucket client root above its rank client roots: a "
                   "client started on it deletes, at start, every .bucket below it without a top-level .meta of "
                   "its id (every rank folder's pairs); never point a client's ssd_offload_path at "
                   f"{store['store']}")
    yield _Hint(_explain(st.cmd, store["namespace"] or store["store"]), f"store {store['store']}: its client roots",
                sr.NOTE_STORE_IS_CLIENT, store["namespace"], 6)


def _unused_ranks(st: _State, store: Store) -> Iterator[Item]:
    """After an SGLang TP shrink, the rank folders of the ranks gone: no client starts there (§9.10)."""
    roots = store["unused_rank_roots"]
    if not roots:
        return
    yield _finding(sr.NOTE_UNUSED_RANKS, 0, store["namespace"],
                   f"store {store['store']}: at TP {store['target_tp']} no SGLang rank starts a client on "
                   f"{', '.join(roots)}: their objects are read by no rank; see the plan (a reshard reads them "
                   "into the target ranks' folders), the folders stay until removed")
    yield _Hint(st.cmd.migrate(), f"store {store['store']}: the plan for the ranks a TP shrink leaves unused",
                sr.NOTE_UNUSED_RANKS, store["namespace"], 5)


def _restart(st: _State, store: Store) -> Iterator[Item]:
    """The master and the clients keep the old index in RAM: restart them after an apply."""
    if not store["pending_objects"]:
        return
    yield _finding(sr.NOTE_RESTART, 0, store["namespace"],
                   f"after migrate --apply on store {store['store']}, restart its Mooncake clients and the master: "
                   "the master keeps the old keys in RAM and a client adopts the new pairs and keys only at start")
    yield _Hint(_proof_command(st, store) or st.cmd.migrate("--apply"), f"apply the migration of store "
                f"{store['store']}, then restart its clients and the master", sr.NOTE_RESTART, store["namespace"], 5)


M_LOCK = sr.LOCK_NAME
STORE_RULES: tuple[Callable[[_State, Store], Iterator[Item]], ...] = (
    _store_assumed, _client_live, _apply_proof, _start_deletes, _start_refused, _unlocked, _store_is_client,
    _unused_ranks, _restart,
)
STORE_DEPLOYMENT_RULES: tuple[Callable[[_State, Store, StoreDeployment], Iterator[Item]], ...] = (
    _entry_statuses, _unserved, _auto_prefix, _new_pairs,
)


def _each_store(st: _State) -> Iterator[Item]:
    """The notes of every Mooncake store and its deployments (mooncake.md §7)."""
    for store in st.summary.get("stores") or ():
        for rule in STORE_RULES:
            yield from rule(st, store)
        for d in store["deployments"]:
            for drule in STORE_DEPLOYMENT_RULES:
                yield from drule(st, store, d)


RULES: tuple[Callable[[_State], Iterator[Item]], ...] = (
    _status_findings, _unreadable_namespaces, _reclaimable, _each_namespace, _each_tier, _each_store, _walk_errors,
    _no_cache,
    _migration_pending,
)


class _Hints:
    """Hints merged by command: the first rule naming a command gives its why and rank;
    every rule adds its code and namespace."""

    def __init__(self) -> None:
        self.by_command: dict[str, Hint] = {}
        self.rank: dict[str, int] = {}

    def add(self, h: _Hint) -> None:
        out = self.by_command.get(h.command)
        if out is None:
            out = self.by_command[h.command] = {"command": h.command, "why": h.why, "codes": [], "namespaces": []}
            self.rank[h.command] = h.rank
        if h.code not in out["codes"]:
            out["codes"].append(h.code)
        if h.namespace is not None and h.namespace not in out["namespaces"]:
            out["namespaces"].append(h.namespace)

    def ask_facts_per_namespace(self, st: _State) -> None:
        """Facts asked of namespaces of several models: one global flag set would state one
        model's facts for all of them; the skeleton holds one entry per namespace instead."""
        asking = [h for h in self.by_command.values() if set(h["codes"]) & FACT_CODES]
        models = {n["model_name"] for n in st.summary["namespaces"] for h in asking
                  if n["source_base"] in h["namespaces"]}
        if len(models) <= 1:
            return
        names = sorted({b for h in asking for b in h["namespaces"]})
        for h in asking:
            del self.by_command[h["command"]]
            del self.rank[h["command"]]
        skeleton = st.cmd.facts_skeleton()
        self.add(_Hint(skeleton, f"{len(names)} namespaces of {len(models)} models need facts stated: write one "
                       "FACTS.json entry per namespace (every fact its target needs, null where unknown), fill in the "
                       f"nulls, then {st.verb} again with --facts FACTS.json (one global flag set would state one "
                       "model's facts for all)", "facts_needed", None, 1))
        for base in names:
            self.by_command[skeleton]["namespaces"].append(base)

    def ordered(self) -> list[Hint]:
        return sorted(self.by_command.values(), key=lambda h: self.rank[h["command"]])


def findings_and_hints(summary: SummaryCore, *, verb: str = "scan",
                       examples: dict[tuple, tuple[str, str | None]] | None = None
                       ) -> tuple[list[Finding], list[Hint]]:
    """Typed findings (one per namespace and problem) and de-duplicated hints: what the
    RULES yield, in their order."""
    st = _State(summary, Commands(summary, verb), verb, examples or {})
    findings: list[Finding] = []
    hints = _Hints()
    for rule in RULES:
        for item in rule(st):
            if isinstance(item, _Hint):
                hints.add(item)
            else:
                findings.append(item)
    hints.ask_facts_per_namespace(st)
    findings.sort(key=lambda f: SEVERITY_ORDER.index(f["severity"]))
    return findings, hints.ordered()


def replicas_unhashed(summary: Mapping[str, Any], n: Namespace) -> bool:
    """A size scan has not proven namespace `n`'s other-rank replicas equal, so prune's
    figures from it count rank 0's files only; prune's own scan hashes them and takes
    those found equal as well (its figure from this summary is a floor)."""
    return summary.get("verify") != "hash" and len(n["ranks"]) > 1 and bool(n["replicas"]["files"])


def _unreadable_as_prune_takes(summary: ReportOutput, r: Reclaimable) -> None:
    """The hint naming `prune --unreadable-namespaces --only ...` names only folders prune's
    own selection takes (summary["reclaimable"]): a migration journal's target or source
    (which the summary alone does not know) is left to a hint listing its files."""
    taken = {v["namespace"] for v in r["namespaces"] if v["class"] == "unreadable_namespaces"}
    for h in list(summary["hints"]):
        if "--unreadable-namespaces" not in h["command"] or set(h["namespaces"]) <= taken:
            continue
        cmd = Commands(summary, "audit")
        keep = [ns for ns in h["namespaces"] if ns in taken]
        listing = cmd.list_files(h["codes"][0])
        other = next((o for o in summary["hints"] if o["command"] == listing), None)
        if other is None:
            other = {"command": listing, "codes": [], "namespaces": [],
                     "why": "folders of a migration's target or source, which prune never takes: list them"}
            summary["hints"].insert(summary["hints"].index(h), other)
        other["codes"] += [c for c in h["codes"] if c not in other["codes"]]
        other["namespaces"] += [ns for ns in h["namespaces"] if ns not in taken and ns not in other["namespaces"]]
        if keep:
            h["namespaces"] = keep
            h["command"] = cmd.prune("--unreadable-namespaces", only=sorted(keep))
        else:
            summary["hints"].remove(h)


def with_reclaimable_figures(summary: ReportOutput) -> ReportOutput:
    """The `reclaimable` hint says prune's own figures (summary["reclaimable"]: its
    selection, the migrated class) summed over every namespace it names; hints merge by
    command, so the text made for the first namespace would speak for all of them."""
    r = summary.get("reclaimable")
    if r is None:
        return summary
    _unreadable_as_prune_takes(summary, r)
    for h in summary["hints"]:
        if "reclaimable" not in h["codes"]:
            continue
        rows = [v for v in r["namespaces"] if v["class"] == "migrated" and v["namespace"] in h["namespaces"]]
        if not rows:
            continue
        files, nbytes = sum(v["files"] for v in rows), sum(v["bytes"] for v in rows)
        freed, unlinked = sum(v["freed_bytes"] for v in rows), sum(v["unlinked_files"] for v in rows)
        floor = "at least " if any(replicas_unhashed(summary, n) for n in summary["namespaces"]
                                   if n["source_base"] in h["namespaces"]) else ""
        h["why"] = (f"{floor}{plural(files, 'legacy file')} ({human_bytes(nbytes)}) already in their target: "
                    f"prune frees {floor}{human_bytes(freed)} once purged and unlinks "
                    f"{plural(unlinked, 'file')} whose bytes the target keeps (the engine's evictors count "
                    "both names)"
                    + ("; this scan did not hash the other ranks' replicas: prune, which does, also takes those it "
                       "proves equal" if floor else "")
                    + "; see what prune reclaims (dry run), then add --apply")
    return summary


def with_unfinished_runs(summary: ReportOutput, runs: list[Run]) -> ReportOutput:
    """The summary plus the root's unfinished runs (`kvmigrate.migrate.runs`, as dicts):
    an `unfinished_run` finding each, first among the hints the command that resumes an
    interrupted one (and the one that undoes it), exit bit 1 while one is interrupted."""
    summary["unfinished_runs"] = runs
    findings: list[Finding] = []
    hints: list[Hint] = []
    for r in runs:
        if r["state"] == "running":
            f = _finding("unfinished_run", 0, None, f"{r['kind']} run {r['run_id']} is running (pid "
                         f"{r['holder']}; journal {r['journal']})")
            f["run"] = r["run_id"]
            findings.append(f)
            continue
        held = f"; it holds {', '.join(r['targets'])}: a new migration there refuses" if r["targets"] else ""
        f = _finding("unfinished_run", 1, None, f"{r['kind']} run {r['run_id']} was interrupted "
                     f"(journal {r['journal']}){held}; resume it, or undo it: {r['undo_command']}")
        f["run"] = r["run_id"]
        findings.append(f)
        if r["resume_command"]:
            hints.append({"command": r["resume_command"], "why": f"resume the interrupted {r['kind']} run "
                          f"{r['run_id']} (or undo it: {r['undo_command']})", "codes": ["unfinished_run"],
                          "namespaces": []})
        summary["exit_code"] = summary["exit_code"] | 1
    summary["findings"] = findings + summary["findings"]
    summary["findings"].sort(key=lambda f: SEVERITY_ORDER.index(f["severity"]))
    summary["hints"] = hints + summary["hints"]
    return summary
