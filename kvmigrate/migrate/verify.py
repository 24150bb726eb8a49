"""Re-check a root after a migration (interface.md §1 `verify`).

Phases, restic-check style, each with typed findings:
  1. namespaces: every base folder with a config.json must hash to its folder name
     (vllm/llmd recipe, or the vllm.cpp recipe for vllm.cpp identities). With a journal,
     only the target namespaces of its runs are judged (the migration made or wrote into
     them); a finding of any other namespace is reported as not related (`related`
     False, no exit bit): it was there before, and `audit` deals with it;
  2. journal (if given): every block the migration created still exists with the
     journaled inode, size and XXH3-128 (a hard link journaled without a hash: its
     mtime); a vllm.cpp output must pass the engine's
     header checks for its namespace, and the checksum attribute vLLM may keep
     (formats/checksum.py) must match its bytes; a created config.json is unchanged. A journaled
     block that is gone was removed by the engine's evictor: `evicted` (bit 1; bit 4
     with strict=True). A journal of a migration into another root is refused (2).
Exit: 0 clean, 1 evicted blocks, 4 integrity findings, +8 when something could not be read
(of what is judged).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Any

from kvmigrate import families, layout, pacing
from kvmigrate.errors import EXIT_FINDINGS, EXIT_INTEGRITY, EXIT_OPERATIONAL, UsageError
from kvmigrate.formats import checksum, vllmcpp
from kvmigrate.identity import canonical
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate.fsops import DestTree, SymlinkInPath, check_relpath
from kvmigrate.selection import Selection, journal_bases
from kvmigrate.units import plural

# the findings of phase 1: a namespace's config.json does not prove its folder name
NAMESPACE_CODES = ("config_digest_mismatch", "config_invalid")


@dataclass(frozen=True)
class Finding:
    code: str  # config_digest_mismatch, config_invalid, evicted, block_replaced, block_changed, ...
    path: str
    message: str
    bits: int = EXIT_INTEGRITY
    # judged: the root without a journal, or what the journal's migration created or wrote
    # into; else a namespace the migration never touched (reported, no exit bit)
    related: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "path": self.path, "message": self.message, "related": self.related}


# The scan summary's keys verify prints (interface.md §1): its totals, not its findings,
# hints or temporary manifest, which are `audit`'s business and do not outlive the walk.
SUMMARY_KEYS = ("summary_version", "tool_version", "target_profile", "totals", "namespaces", "outside_namespaces",
                "walk_errors")


@dataclass
class VerifyResult:
    root: str
    strict: bool = False  # evicted blocks are integrity findings (bit 4), not findings (bit 1)
    namespaces: int = 0
    blocks: int = 0
    configs: int = 0
    journals: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)  # the root's scan summary (interface.md §1 keys)

    @property
    def exit_code(self) -> int:
        code = 0
        for f in self.findings:
            code |= f.bits if f.related else 0
        return code

    def next_step(self) -> str:
        """What to do about the findings (the text's last line, the JSON's `next`), one
        clause per kind: each kind has its own remedy."""
        if not self.findings:
            return "no findings"
        judged = [f for f in self.findings if f.related]
        evicted = [f for f in judged if f.code == "evicted"]
        names = [f for f in judged if f.code in NAMESPACE_CODES]
        unread = [f for f in judged if f.bits & EXIT_OPERATIONAL]
        outputs = [f for f in judged if f not in evicted and f not in names and f not in unread]
        lines = []
        if evicted:
            lines.append(f"{plural(len(evicted), 'journaled block')} removed since the migration, as the engine's "
                         "evictor removes blocks: nothing to repair")
        if outputs:
            lines.append(f"{plural(len(outputs), 'file')} the migration created no longer "
                         f"{'matches' if len(outputs) == 1 else 'match'} the journal: not what it wrote; move "
                         f"{'it' if len(outputs) == 1 else 'them'} aside, then rerun `kvmigrate migrate --apply` "
                         "(or undo the migration with `kvmigrate rollback`)")
        if names:
            one = len(names) == 1
            lines.append(f"{plural(len(names), 'namespace')} whose config.json does not hash to its folder name: "
                         f"no engine reads {'it' if one else 'them'} under that name; see why with "
                         + ", ".join(f"`kvmigrate identity {f.path}`" for f in names[:3])
                         + (f" and {len(names) - 3} more" if len(names) > 3 else ""))
        if unread:
            lines.append(f"{plural(len(unread), 'path')} could not be read: fix the permissions or the disk, then "
                         "verify again")
        if self.journals and not judged:
            lines.append("what the migration created matches its journal")
        others = len(self.findings) - len(judged)
        if others:
            lines.append(f"{plural(others, 'finding')} outside it (a namespace the migration neither created nor "
                         "wrote into): not this migration's, so not in the exit code; "
                         f"`kvmigrate audit {self.root}` reports {'it' if others == 1 else 'them'} with what to do")
        return "; ".join(lines) + "."

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.summary)
        out.update({"root": self.root, "checked": {"namespaces": self.namespaces, "blocks": self.blocks,
                                                   "configs": self.configs},
                    "journals": self.journals, "findings": [f.to_dict() for f in self.findings],
                    "strict": self.strict, "next": self.next_step(), "exit_code": self.exit_code})
        return out


def check_namespaces(root: str, result: VerifyResult, selection: Selection | None = None,
                     judged: set[str] | None = None) -> None:
    """Phase 1: every base folder's config.json proves its digest. `judged`: the base
    folders whose findings count (a journal's targets), None for all of them."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as exc:
        result.findings.append(Finding("unreadable", root, f"cannot list the root: {exc.strerror}", EXIT_OPERATIONAL))
        return
    for entry in entries:
        folder = layout.parse_folder(entry.name)
        if folder is None or folder.rank is not None or not entry.is_dir(follow_symlinks=False):
            continue
        if selection and not selection.admits([folder.safe_model, entry.name]):  # known by its folder name
            continue
        related = judged is None or entry.name in judged
        cfg = os.path.join(entry.path, layout.CONFIG_NAME)
        try:
            st = os.lstat(cfg)
        except FileNotFoundError:
            continue
        except OSError as exc:
            result.findings.append(Finding("unreadable", cfg, exc.strerror or str(exc), EXIT_OPERATIONAL, related))
            continue
        result.namespaces += 1
        if not stat.S_ISREG(st.st_mode):
            result.findings.append(Finding("config_invalid", cfg, "config.json is not a regular file",
                                           related=related))
            continue
        try:
            with open(cfg, "rb") as f:
                data = f.read(1 << 22)
        except OSError as exc:
            result.findings.append(Finding("unreadable", cfg, exc.strerror or str(exc), EXIT_OPERATIONAL, related))
            continue
        try:
            fields = canonical.fields_from_config_bytes(data)
        except ValueError as exc:
            result.findings.append(Finding("config_invalid", cfg, str(exc), related=related))
            continue
        family = families.of_identity(fields).name
        got = canonical.d12(fields, family)
        if got != folder.d12:
            result.findings.append(Finding("config_digest_mismatch", cfg,
                                           f"config.json hashes to {got}, the folder name says {folder.d12} "
                                           f"({family} recipe)", related=related))


def check_journal(journal: str, result: VerifyResult, selection: Selection | None = None) -> None:
    """Phase 2: every journaled output is still what the migration wrote."""
    for path, run in ((f, run) for f in jn.journal_files(journal) for run in jn.stream_runs(f)):
        _check_same_root(path, run, result.root)
        if path not in result.journals:
            result.journals.append(path)
        if run.rolled_back:
            continue
        if not os.path.isdir(run.dest):
            result.findings.append(Finding("dest_missing", run.dest, "destination root of the journal is missing"))
            continue
        kept = journal_bases(run.targets, selection) if selection else None
        _check_stores(run, result)
        with DestTree(run.dest) as tree:
            for rec in jn.done_records(run):  # read from the journal, one at a time
                kind = rec.get("kind")
                if kept is not None and run.target_of(rec["path"]) not in kept:
                    continue
                check_relpath(rec["path"], f"{path}: journal path")
                if kind == "block":
                    if pacing.expired():  # (a clock read: cheap next to a hash)
                        raise pacing.OutOfTime(
                            f"--max-duration elapsed after {plural(result.blocks, 'journaled block')} were checked "
                            f"({plural(len(result.findings), 'finding')} so far); verify writes nothing and starts over")
                    result.blocks += 1
                else:
                    result.configs += 1
                _check_output(tree, run, rec, result)


def _check_stores(run: jn.Run, result: VerifyResult) -> None:
    """A Mooncake store's rewritten indexes and placed KVEntries (migrate/store_undo.py): an
    index the client since evicted is `evicted` (bit 1), anything else changed bit 4."""
    from kvmigrate.migrate.store_undo import verify_run

    checked, found = verify_run(run)
    result.blocks += checked
    for code, message in found:
        path = message.split(": ", 1)[0]
        if code == "missing":
            result.findings.append(Finding("evicted", path, message, EXIT_FINDINGS))
        else:
            result.findings.append(Finding(f"block_{code}", path, message))


def _check_same_root(path: str, run: jn.Run, root: str) -> None:
    """A journal checks the root its migration wrote into, no other: under another root
    its blocks would be looked up in the wrong place and "verified" by what is missing."""
    if os.path.realpath(run.dest) != os.path.realpath(root):
        raise UsageError(f"journal {path} is of a migration into {run.dest}, not into {root}", path=path,
                         hint=f"kvmigrate verify {run.dest} --journal {path}, or pass the journal of {root} "
                              f"(default: {jn.default_journal_dir(root)})")


def _check_output(tree: DestTree, run: jn.Run, rec: dict[str, Any], result: VerifyResult) -> None:
    path = rec["path"]
    where = tree.abspath(path)
    try:
        st = tree.lstat(path)
    except (SymlinkInPath, NotADirectoryError):
        result.findings.append(Finding("block_replaced", where, "a parent folder is now a symlink or a file"))
        return
    if st is None:
        if rec["kind"] == "block":  # evictors unlink whole block files (and empty folders)
            result.findings.append(Finding("evicted", where, "created by the migration, since removed (evicted)",
                                           EXIT_INTEGRITY if result.strict else EXIT_FINDINGS))
        else:
            result.findings.append(Finding("config_missing", where, "created by the migration, now missing"))
        return
    if not stat.S_ISREG(st.st_mode) or st.st_ino != rec.get("ino") or st.st_dev != rec.get("dev", st.st_dev):
        result.findings.append(Finding(f"{rec['kind']}_replaced", where,
                                       f"inode {st.st_ino} is not the journaled {rec.get('ino')}"))
        return
    if st.st_size != rec.get("size"):
        result.findings.append(Finding(f"{rec['kind']}_changed", where,
                                       f"{st.st_size} bytes, the journal says {rec.get('size')}"))
        return
    by_identity = rec.get("xxh3_128") is None and rec.get("how") == "link"
    try:
        have = None if by_identity else tree.hash(path)[0]
        head = tree.read_bytes(path, limit=vllmcpp.HEADER_SIZE) if rec["kind"] == "block" else b""
    except OSError as exc:
        result.findings.append(Finding("unreadable", where, exc.strerror or str(exc), EXIT_OPERATIONAL))
        return
    if by_identity and st.st_mtime_ns != rec.get("mtime_ns"):
        # a hard link journaled by identity (the source's inode; no hash was taken)
        result.findings.append(Finding(f"{rec['kind']}_changed", where,
                                       "modified since the migration (its mtime is not the journaled one; "
                                       "a hard link shares its source's inode)"))
        return
    if have is not None and have.hex() != rec.get("xxh3_128"):  # (have: None when by_identity)
        result.findings.append(Finding(f"{rec['kind']}_changed", where,
                                       "content differs from the journaled XXH3-128 (tampered or rewritten)"))
        return
    if rec["kind"] != "block":
        return
    try:
        bad_sum = _checksum_mismatch(tree, path)
    except OSError as exc:
        result.findings.append(Finding("unreadable", where, exc.strerror or str(exc), EXIT_OPERATIONAL))
        return
    if bad_sum:
        result.findings.append(Finding("checksum_mismatch", where, bad_sum))
        return
    parsed = layout.parse_block_relpath(path)
    folder = layout.parse_folder(path.split("/", 1)[0])
    target = run.targets.get(folder.base) if folder is not None else None
    tier = run.targets.get(run.target_of(path) or "") if folder is None else None
    if tier is not None and tier.get("flat"):  # a tier family's file: re-parsed as its engine reads it
        try:
            found = families.get(tier.get("family")).verify_tier_file(path, st.st_size, tree.read_bytes)
        except OSError as exc:
            result.findings.append(Finding("unreadable", where, exc.strerror or str(exc), EXIT_OPERATIONAL))
            return
        if found:
            result.findings.append(Finding(found[0], where, found[1]))
        return
    if target:  # the target engine's own checks of the block (Family.verify_block)
        block = parsed[1] if parsed is not None else None
        found = families.get(target.get("family")).verify_block(
            head, st.st_size, target, block.hex_hash if block else None, block.group if block else 0)
        if found:
            result.findings.append(Finding(found[0], where, found[1]))


def _checksum_mismatch(tree: DestTree, path: str) -> str | None:
    """The engine's checksum attribute of a block, where it has one, against its bytes."""
    dfd, name = tree.split(path)
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        return checksum.mismatch(fd)
    finally:
        os.close(fd)


def journal_target_profile(journal: str) -> str | None:
    """The target profile of the journal's last run that names one (verify's summary
    scans for it when no --target is given)."""
    profiles = [run.header.get("target_profile") for f in jn.journal_files(journal) for run in jn.run_states(f)]
    return next((p for p in reversed(profiles) if p), None)


def verify_root(root: str, journal: str | None = None, *, strict: bool = False,
                selection: Selection | None = None) -> VerifyResult:
    """The checks of `kvmigrate verify` (strict=True makes evicted blocks integrity
    findings); kvmigrate.pipeline.verify adds the root's scan summary. `selection`
    (--only/--exclude): the namespaces and journaled targets it keeps only."""
    result = VerifyResult(root=os.path.abspath(root), strict=strict)
    check_namespaces(result.root, result, selection, None if journal is None else journal_targets(journal))
    if journal is not None:
        check_journal(journal, result, selection)
    return result


def journal_targets(journal: str) -> set[str]:
    """The target namespaces of a journal's runs that were not rolled back: what its
    migration created or wrote into (their config.json must prove their name)."""
    return {base for path in jn.journal_files(journal) for run in jn.run_states(path) if not run.rolled_back
            for base in run.targets}


def render(result: VerifyResult) -> str:
    lines = [f"verified {result.root}: {plural(result.namespaces, 'namespace config.json', 'namespace config.json files')}"
             + (f", {plural(result.blocks, 'journaled block')} and "
                f"{plural(result.configs, 'config.json', 'config.json files')} from "
                f"{plural(len(result.journals), 'journal')}" if result.journals else "")]
    for f in result.findings:
        lines.append(f"  {f.code}: {f.path}: {f.message}" + ("" if f.related else " (not this migration's)"))
    lines.append(result.next_step())
    return "\n".join(lines)
