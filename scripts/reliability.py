#!/usr/bin/env python3
"""The reliability campaign: crash consistency, injected faults, a live engine, hostile input.

    python scripts/reliability.py            # full campaign -> reports/RELIABILITY.md (+ .json)
    python scripts/reliability.py --quick    # a few of each, report under --out (default: a temp dir)

What it does (issue 8; migration.md §3 is the rule book):

1. crash     `kvmigrate migrate --apply` in a subprocess on synth trees (vLLM S1 re-key
             links, llm-d MLA copy_pad, vllm.cpp rewrite_header, a mixed root, --mode copy),
             killed with SIGKILL at randomized points (the KVMIGRATE_CRASH_AT hook with a
             random count, or a random delay after the journal appears), sometimes twice,
             then rerun. After every kill: sources unchanged (inode, size, mtime_ns, mode,
             SHA-256), every file at a final path holds the bytes an uninterrupted run
             writes there, the journal accounts for every new path and its done records
             match the files. After the rerun: the tree equals an uninterrupted run's
             (bytes, and linked files share the source's inode), `verify` passes, and
             `rollback` restores the pre-migration listing and bytes.
2. faults    ENOSPC on a 256 KiB tmpfs (injected write failure if mount is refused),
             EXDEV (/dev/shm, and a bind mount of the same filesystem), EROFS (a read-only
             bind mount), EACCES (as uid 65534 via setpriv), EMLINK (an os.link shim; a real
             ext4 65000-link limit in the full run): the documented message, exit code, a
             consistent journal, and a rerun after fixing the condition that ends like an
             uninterrupted run.
3. engine    tests/engine_sim.py writes, loads and evicts blocks like each engine while
             `scan --verify hash` and `migrate --apply` run on the same root.
4. hostile   hypothesis-built roots (garbage config.json, wrong types, deep nesting, names
             with `..`, non-UTF-8 names, symlink loops and links out of the root, FIFOs,
             device files, empty and 1 TiB sparse block files): scan, audit, migrate (dry
             run and --apply) never print a traceback, exit with documented bits, never
             follow a link out of the root and never write outside it.

Every command is recorded; every non-zero exit must come with a message naming a path
and a remedy. Any violation is listed in the report and makes the script exit 1.
Needs root (mount, mknod, setpriv); without it the mount-based faults fall back to
injected ones and say so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import errno
import hashlib
import json
import os
import platform
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import xxhash

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import engine_sim  # noqa: E402  (tests/engine_sim.py)

from kvmigrate import layout  # noqa: E402
from kvmigrate.formats import vllmcpp  # noqa: E402
from kvmigrate.migrate.apply import CRASH_ENV  # noqa: E402
from kvmigrate.synth import SynthSpec, build  # noqa: E402

KVMIGRATE = str(Path(sys.executable).with_name("kvmigrate")) if Path(sys.executable).with_name(
    "kvmigrate").exists() else (shutil.which("kvmigrate") or "kvmigrate")
NOBODY = 65534
SETPRIV = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
OWN = layout.OWN_DIR
TMP_RE = layout.OWN_TMP_RE
GEOMETRY = dict(layers=2, page_bytes=256)
FACTS = {"org/full-model": {"kv_kind": "full", "total_kv_heads": 8, "model_dtype": "bfloat16"},
         "org/mla-model": {"kv_kind": "mla", "model_dtype": "bfloat16"},
         "org/cpp-model": {"kv_kind": "mla", "model_dtype": "bfloat16"}}
VLLM_LINK = {"family": "vllm", "scheme": "S1", "tp": 1, "model_name": "org/full-model"}
LLMD_COPY_PAD = {"family": "llmd", "tp": 2, "kv_kind": "mla", "model_name": "org/mla-model"}
CPP_REWRITE = {"family": "vllmcpp", "tp": 2, "kv_kind": "mla", "model_name": "org/cpp-model"}
INTERFACE_BITS = 1 | 2 | 4 | 8  # interface.md §4 (32 only on Ctrl-C / SIGTERM)
HINT_RE = re.compile(r"hint:|rerun|resume|\brun\b|\bpass\b|\buse --|--mode|--apply|remove|move it|free space|"
                     r"remount|wait for|kvmigrate \w+|chmod|chown|\bsee\b|\$ ", re.I)
PATH_RE = re.compile(r"(?<![\w.])/(?:[^\s'\"():,;]+)")


# ---------------------------------------------------------------------------------------
# Recording commands and violations


@dataclass
class Run:
    label: str
    argv: list[str]
    rc: int
    stdout: str
    stderr: str
    seconds: float
    user: str = "root"
    env: dict[str, str] = field(default_factory=dict)

    @property
    def killed(self) -> bool:
        return self.rc < 0

    def brief(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        who = "" if self.user == "root" else f"[as {self.user}] "
        return f"{who}{env + ' ' if env else ''}kvmigrate {' '.join(self.argv)} -> {self.rc}"


def message_problem(run: Run) -> str | None:
    """None if a non-zero exit explains itself: a path and a remedy, on stderr for
    usage/operational stops (bits 2, 8, 32), anywhere in the output for findings."""
    if run.rc <= 0:
        return None
    text = run.stderr if run.rc & (2 | 8 | 32) else run.stdout + run.stderr
    where = "stderr" if run.rc & (2 | 8 | 32) else "output"
    missing = []
    if not PATH_RE.search(text):
        missing.append("a path")
    if not HINT_RE.search(text):
        missing.append("a remedy")
    return f"exit {run.rc}: {where} lacks {' and '.join(missing)}" if missing else None


class Ledger:
    """Every command run, every violation found, and the campaign's counters."""

    def __init__(self) -> None:
        self.runs: list[Run] = []
        self.violations: list[str] = []
        self.counts: Counter = Counter()
        self.notes: list[str] = []

    def violate(self, kind: str, detail: str) -> None:
        self.counts[f"violation:{kind}"] += 1
        self.violations.append(f"[{kind}] {detail}")

    def cli(self, label: str, *args: Any, env: dict[str, str] | None = None, user: str | None = None,
            timeout: float = 300, allowed: Callable[[int], bool] | None = None, cwd: str | None = None) -> Run:
        """Run one kvmigrate command and check what every command must satisfy."""
        argv = [str(a) for a in args]
        full_env = dict(os.environ)
        full_env.pop(CRASH_ENV, None)
        full_env.update(env or {})
        cmd = ([*SETPRIV] if user == "nobody" else []) + [KVMIGRATE, *argv]
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, capture_output=True, env=full_env, timeout=timeout, cwd=cwd)
            rc, out, err = p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
        except subprocess.TimeoutExpired as exc:
            rc, out, err = -999, (exc.stdout or b"").decode("utf-8", "replace"), (exc.stderr or b"").decode(
                "utf-8", "replace")
        run = Run(label, argv, rc, out, err, time.monotonic() - t0, user or "root", dict(env or {}))
        self.record(run, allowed)
        return run

    def record(self, run: Run, allowed: Callable[[int], bool] | None = None) -> None:
        self.runs.append(run)
        self.counts["commands"] += 1
        if run.rc == -999:
            self.violate("hang", f"{run.label}: {run.brief()} did not finish in time")
        if "Traceback" in run.stderr or "Traceback" in run.stdout:
            self.violate("traceback", f"{run.label}: {run.brief()}\n{_tail(run.stderr or run.stdout, 12)}")
        if run.rc >= 0 and allowed is not None and not allowed(run.rc):
            self.violate("exit_code", f"{run.label}: {run.brief()}\n{_tail(run.stderr + run.stdout, 8)}")
        problem = message_problem(run)
        if problem:
            self.violate("message", f"{run.label}: {run.brief()}: {problem}\n{_tail(run.stderr + run.stdout, 6)}")
        if run.rc > 0:
            self.counts["nonzero_exits"] += 1


def _tail(text: str, n: int) -> str:
    lines = text.strip().splitlines()[-n:]
    return textwrap.indent("\n".join(lines), "    | ")


def bits_only(*ok: int) -> Callable[[int], bool]:
    """An exit code made of the interface's bits, and one of `ok` if given."""
    def check(rc: int) -> bool:
        return rc & ~INTERFACE_BITS == 0 and (not ok or rc in ok)
    return check


# ---------------------------------------------------------------------------------------
# Trees: build, snapshot, compare


def build_root(root: Path, specs: list[dict], blocks: int, seed: int = 0) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for s in specs:
        build(root, SynthSpec(**{**GEOMETRY, "blocks": blocks, "seed": seed, **s}))


def sha256_file(path: str) -> str:
    flags = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NOATIME", 0)
    try:
        fd = os.open(path, flags)
    except PermissionError:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    h = hashlib.sha256()
    try:
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            h.update(b)
    finally:
        os.close(fd)
    return h.hexdigest()


def xxh_file(path: str) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Entry:
    kind: str  # file | dir | link | fifo | chr | blk | other
    ino: int
    size: int
    mtime_ns: int
    mode: int
    digest: str | None  # SHA-256 of a file, target of a symlink
    atime_ns: int = 0

    def facts(self) -> tuple:
        """What must stay equal for a source file (safety rule 1); folders: kind only."""
        if self.kind == "dir":
            return ("dir",)
        return (self.kind, self.ino, self.size, self.mtime_ns, self.mode, self.digest)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "dir"), (stat.S_ISLNK, "link"),
                       (stat.S_ISFIFO, "fifo"), (stat.S_ISCHR, "chr"), (stat.S_ISBLK, "blk")):
        if test(mode):
            return name
    return "other"


SPARSE_HASH_LIMIT = 1 << 30  # enormous sparse files are compared by size and inode only


def snapshot(root: str | Path, exclude_top: tuple[str, ...] = (OWN,)) -> dict[str, Entry]:
    """Every entry under root, never following symlinks (names may be non-UTF-8)."""
    root = str(root)
    out: dict[str, Entry] = {}
    for dirpath, dirs, files in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirs[:] = [d for d in dirs if d not in exclude_top]
            files = [f for f in files if f not in exclude_top]
        for name in dirs + files:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            p = os.path.join(root, rel)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            kind = _kind(st.st_mode)
            digest = None
            if kind == "file" and st.st_size <= SPARSE_HASH_LIMIT:
                try:
                    digest = sha256_file(p)
                except FileNotFoundError:
                    continue
            elif kind == "link":
                digest = os.readlink(p)
            out[rel] = Entry(kind, st.st_ino, st.st_size if kind != "dir" else 0, st.st_mtime_ns,
                             st.st_mode, digest, st.st_atime_ns)
    return out


def normalized(snap: dict[str, Entry], sources: dict[int, str]) -> dict[str, tuple]:
    """Entries by (kind, content, which source file a new file is a hard link of): two
    runs on identical trees compare equal whatever their inode numbers."""
    return {rel: (e.kind, e.digest, sources.get(e.ino) if e.kind == "file" else None) for rel, e in snap.items()}


def source_changes(before: dict[str, Entry], root: Path) -> list[str]:
    """Source files (those in `before`) whose inode, size, mtime, mode or bytes changed."""
    out = []
    for rel, e in before.items():
        if e.kind == "dir":
            continue
        p = os.path.join(root, rel)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            out.append(f"{rel}: vanished")
            continue
        kind = _kind(st.st_mode)
        digest = e.digest
        if kind == "file" and e.digest is not None and (st.st_ino, st.st_size, st.st_mtime_ns) == (
                e.ino, e.size, e.mtime_ns):
            digest = sha256_file(p)
        now = (kind, st.st_ino, st.st_size if kind != "dir" else 0, st.st_mtime_ns, st.st_mode, digest)
        if now != e.facts():
            out.append(f"{rel}: {e.facts()} -> {now}")
    return out


# ---------------------------------------------------------------------------------------
# Journals: an independent reader (not the library's) for the consistency checks


def journal_paths(where: Path) -> list[Path]:
    """Journals of a root (ROOT/.kvmigrate/journals), of a journal directory, or a file."""
    where = Path(where)
    if where.is_file():
        return [where]
    d = where / OWN / "journals"
    if d.is_dir():
        return sorted(d.glob("*.jsonl"))
    return sorted(where.glob("*.jsonl")) if where.is_dir() else []


def parse_journal(path: Path) -> tuple[list[dict], list[str]]:
    """Records and problems: every complete line must be a JSON object with a type, the
    first a header; only the last line may be torn (a kill mid-write)."""
    problems = []
    data = path.read_bytes()
    lines = data.split(b"\n")
    torn = lines.pop()  # b"" when the file ends with a newline
    records = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            problems.append(f"{path.name}: line {i + 1} is not JSON: {line[:80]!r}")
            continue
        if not isinstance(rec, dict) or "t" not in rec:
            problems.append(f"{path.name}: line {i + 1} has no record type")
            continue
        records.append(rec)
    if torn:
        try:
            json.loads(torn)
            problems.append(f"{path.name}: a complete record lacks its newline")
        except ValueError:
            pass  # a torn last line is allowed
    if records and records[0]["t"] != "header":
        problems.append(f"{path.name}: first record is {records[0]['t']}, not header")
    return records, problems


@dataclass
class JournalView:
    intents: dict[str, dict] = field(default_factory=dict)  # path -> item (every run)
    tmps: set[str] = field(default_factory=set)
    done: dict[str, dict] = field(default_factory=dict)  # path -> last done record (live runs)
    dirs_done: set[str] = field(default_factory=set)
    skips: dict[str, dict] = field(default_factory=dict)
    targets: dict[str, dict] = field(default_factory=dict)
    complete: bool = False
    problems: list[str] = field(default_factory=list)


def read_journals(where: Path) -> JournalView:
    view = JournalView()
    for path in journal_paths(where):
        records, problems = parse_journal(path)
        view.problems += problems
        rolled_back = any(r["t"] == "rolled_back" for r in records)
        for r in records:
            t = r["t"]
            if t == "intent":
                for item in r.get("items", []):
                    view.intents[item["path"]] = item
                    if item.get("tmp"):
                        view.tmps.add(item["tmp"])
            elif t == "done" and not rolled_back:
                if r.get("kind") == "dirs":
                    view.dirs_done.update(r.get("paths", []))
                else:
                    view.done[r["path"]] = r
            elif t == "skip":
                view.skips[r["path"]] = r
            elif t == "target":
                view.targets[r["base"]] = r
            elif t == "complete" and not rolled_back:
                view.complete = True
            elif t == "resume":
                view.complete = False
    return view


def check_after_kill(root: Path, dest: Path, pristine: dict[str, Entry], ref: dict[str, Entry],
                     journal_root: Path, ignore: frozenset[str] = frozenset(),
                     dest_before: dict[str, Entry] | None = None) -> list[tuple[str, str]]:
    """(kind, detail) problems of a tree a kill -9 (or a stop) just left: safety rules
    1, 3 and 5. `journal_root`: a root, journal directory or journal file; `ignore`:
    paths under dest that are not the migration's (a journal kept there)."""
    out = [("lost_source", c) for c in source_changes(pristine, root)]
    view = read_journals(journal_root)
    out += [("journal", p) for p in view.problems]
    snap = snapshot(dest)
    dest_pristine = pristine if dest == root else (dest_before or {})
    for rel, rec in view.done.items():
        e = snap.get(rel)
        if e is None or e.kind != "file":
            out.append(("journal", f"done record for {rel} but no file there"))
            continue
        if e.ino != rec.get("ino") or e.size != rec.get("size") or xxh_file(str(dest / rel)) != rec.get("xxh3_128"):
            out.append(("journal", f"done record for {rel} does not match the file (inode, size or hash)"))
    for rel, e in snap.items():
        if rel in dest_pristine or rel in ignore:
            continue
        if e.kind == "dir":
            if rel not in view.intents and rel not in view.dirs_done:
                out.append(("journal", f"folder {rel} is not accounted for by the journal"))
            continue
        name = os.path.basename(rel)
        if TMP_RE.search(name):
            if rel not in view.tmps:
                out.append(("journal", f"temp file {rel} is not listed by any intent"))
            continue
        if name == layout.LOCK_NAME:
            continue
        want = ref.get(rel)
        if want is None or want.digest != e.digest:
            out.append(("clobbered", f"{rel}: a file at a final path that an uninterrupted run would not write "
                                     f"({'unexpected path' if want is None else 'other bytes'})"))
        if rel not in view.intents and rel not in view.done:
            out.append(("journal", f"{rel} is at a final path but no journal record accounts for it"))
    return out


# ---------------------------------------------------------------------------------------
# 1. Crash consistency


@dataclass
class Scenario:
    name: str
    specs: list[dict]
    blocks: int
    mode: str = "link"
    dest_separate: bool = False


SCENARIOS = [
    Scenario("vllm-S1-link", [VLLM_LINK], blocks=16),
    Scenario("llmd-MLA-copy_pad", [LLMD_COPY_PAD], blocks=12),
    Scenario("vllmcpp-rewrite_header", [CPP_REWRITE], blocks=12),
    Scenario("mixed-3-families", [LLMD_COPY_PAD, VLLM_LINK, CPP_REWRITE], blocks=6),
    Scenario("vllm-S1-mode-copy", [VLLM_LINK], blocks=12, mode="copy"),
]
POINTS = ("intent", "tmp_written", "linked", "created")


class CrashBench:
    """One scenario's trial root (restored by rollback between trials), its manifest,
    and the reference: an uninterrupted run on an identical twin root."""

    def __init__(self, scn: Scenario, work: Path, ledger: Ledger):
        self.scn = scn
        self.ledger = ledger
        self.dir = work / "crash" / scn.name
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.facts = self.dir / "facts.json"
        self.facts.write_text(json.dumps(FACTS))
        self.root = self.dir / "root"
        self.manifest = self.dir / "manifest.parquet"
        self._build_trial_root()
        # the reference run
        ref_root = self.dir / "ref"
        build_root(ref_root, scn.specs, scn.blocks)
        ref_pristine = snapshot(ref_root)
        ref_sources = {e.ino: rel for rel, e in ref_pristine.items() if e.kind == "file"}
        run = ledger.cli(f"crash/{scn.name}/reference", "migrate", ref_root, "--facts", self.facts, "--apply",
                         "--mode", scn.mode, "--json", allowed=bits_only(0))
        self.ref_snap = snapshot(ref_root)
        self.ref_norm = normalized(self.ref_snap, ref_sources)
        self.ref_new = {rel: e for rel, e in self.ref_snap.items() if rel not in ref_pristine}
        view = read_journals(ref_root)
        created = [r for r in view.done.values() if r.get("kind") == "block"]
        self.hits = {"intent": sum(1 for _ in _block_intents(ref_root)),
                     "tmp_written": sum(1 for r in created if r.get("how") == "copy"),
                     "created": len(created)}
        self.hits["linked"] = self.hits["tmp_written"]
        self.summary = json.loads(run.stdout) if run.rc == 0 else {}
        self.window = self._calibrate()

    def _build_trial_root(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        build_root(self.root, self.scn.specs, self.scn.blocks)
        self.pristine = snapshot(self.root)
        self.sources = {e.ino: rel for rel, e in self.pristine.items() if e.kind == "file"}
        self.ledger.cli(f"crash/{self.scn.name}/scan", "scan", self.root, "-o", self.manifest, "--facts", self.facts,
                        allowed=bits_only(0))

    def argv(self, via: str) -> list:
        if via == "manifest":
            return ["migrate", "--manifest", self.manifest, "--apply", "--mode", self.scn.mode]
        return ["migrate", self.root, "--facts", self.facts, "--apply", "--mode", self.scn.mode]

    def _calibrate(self) -> float:
        """Seconds from the journal's creation to the end of an uninterrupted run (the
        window random delays aim at); the run is then rolled back like any trial."""
        run, t_journal, t_end = self._popen(self.argv("manifest"), env={}, kill_after=None)
        run.label = f"crash/{self.scn.name}/calibration"
        self.ledger.record(run, bits_only(0))
        for kind, detail in self._finish(f"crash/{self.scn.name}/calibration"):
            self.ledger.violate(kind, f"{self.scn.name} uninterrupted run: {detail}")
        return max(0.02, (t_end - t_journal) if t_journal else 0.2)

    def _popen(self, argv: list, env: dict, kill_after: float | None) -> tuple[Run, float | None, float]:
        """Start the command; with `kill_after`, SIGKILL it that many seconds after its
        journal appears (or grows, when resuming)."""
        before = {p: p.stat().st_size for p in journal_paths(self.root)}
        full_env = dict(os.environ)
        full_env.pop(CRASH_ENV, None)
        full_env.update(env)
        t0 = time.monotonic()
        proc = subprocess.Popen([KVMIGRATE, *map(str, argv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=full_env)
        t_journal = None
        while proc.poll() is None:
            now = {p: p.stat().st_size for p in journal_paths(self.root)}
            if now != before:
                t_journal = time.monotonic()
                break
            time.sleep(0.001)
        if kill_after is not None and proc.poll() is None:
            time.sleep(kill_after)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
        t_end = time.monotonic()
        run = Run(f"crash/{self.scn.name}", [str(a) for a in argv], proc.returncode,
                  out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), t_end - t0,
                  env={k: v for k, v in env.items()} | ({"KILL_AFTER": f"{kill_after:.4f}s"} if kill_after else {}))
        return run, (t_journal - t0 if t_journal else None), t_end - t0

    def trial(self, seed: int) -> dict[str, Any]:
        """One randomized trial: kill (once or twice), check, rerun, verify, rollback."""
        rng = random.Random(seed)
        scn = self.scn
        via = "manifest" if rng.random() < 0.7 else "scan"
        kills = 2 if rng.random() < 0.2 else 1
        record: dict[str, Any] = {"scenario": scn.name, "seed": seed, "via": via, "kills": []}
        problems: list[tuple[str, str]] = []
        for _ in range(kills):
            how = "hook" if rng.random() < 0.65 else "delay"
            env: dict[str, str] = {}
            kill_after = None
            if how == "hook":
                points = [p for p in POINTS if self.hits.get(p)]
                point = rng.choice(points)
                n = rng.randint(1, self.hits[point])
                env[CRASH_ENV] = f"{point}:{n}"
                where = f"{point}:{n}"
            else:
                kill_after = rng.uniform(0, self.window * 1.1)
                where = f"delay {kill_after * 1000:.1f} ms"
            run, _, _ = self._popen(self.argv(via), env, kill_after)
            run.label = f"crash/{scn.name}/kill"
            self.ledger.record(run, lambda rc: rc == 0)
            killed = run.rc == -signal.SIGKILL
            record["kills"].append({"how": how, "at": where, "killed": killed})
            if killed:
                self.ledger.counts["kill_points"] += 1
                self.ledger.counts[f"kill_points:{how}"] += 1
                problems += check_after_kill(self.root, self.root, self.pristine, self.ref_new, self.root)
            else:
                self.ledger.counts["kill_missed"] += 1  # the run finished before the kill point
        problems += self._finish(f"crash/{scn.name}/rerun", via=via)
        for kind, detail in problems:
            self.ledger.violate(kind, f"{scn.name} seed {seed} ({record['kills']}): {detail}")
        record["ok"] = not problems
        self.ledger.counts["crash_trials"] += 1
        return record

    def _finish(self, run_label: str, via: str = "manifest") -> list[tuple[str, str]]:
        """Rerun to completion, compare with the reference, verify, roll back, compare
        with the pristine tree, and leave the root ready for the next trial."""
        problems: list[tuple[str, str]] = []
        had_journal = any(parse_journal(j)[0] for j in journal_paths(self.root)) and not read_journals(
            self.root).complete
        rerun = self.ledger.cli(run_label, *self.argv(via), "--json", allowed=bits_only(0))
        if rerun.rc == 0:
            summary = json.loads(rerun.stdout)
            if had_journal and not summary["apply"]["resumed"]:
                problems.append(("journal", "the rerun did not resume the interrupted run's journal"))
        snap = snapshot(self.root)
        if normalized(snap, self.sources) != self.ref_norm:
            problems.append(("not_identical", _diff(normalized(snap, self.sources), self.ref_norm)))
        problems += [("lost_source", c) for c in source_changes(self.pristine, self.root)]
        leftovers = [r for r in snap if TMP_RE.search(r) or r.endswith(layout.LOCK_NAME)]
        if leftovers:
            problems.append(("not_identical", f"temp or lock files left: {leftovers[:3]}"))
        journals = journal_paths(self.root)
        jdir = self.root / OWN / "journals"
        ver = self.ledger.cli(f"{run_label}/verify", "verify", self.root, "--journal", jdir, allowed=bits_only(0))
        rb = self.ledger.cli(f"{run_label}/rollback", "rollback", jdir, allowed=bits_only(0))
        after = snapshot(self.root)
        if {r: e.facts() for r, e in after.items()} != {r: e.facts() for r, e in self.pristine.items()}:
            problems.append(("rollback", "rollback did not restore the pre-migration tree: "
                             + _diff({r: e.facts() for r, e in after.items()},
                                     {r: e.facts() for r, e in self.pristine.items()})))
        for j in journals:
            j.unlink()
        if problems or ver.rc or rb.rc:
            self._build_trial_root()  # start the next trial from a clean tree
        return problems


def _block_intents(root: Path) -> Iterator[dict]:
    for path in journal_paths(root):
        for rec in parse_journal(path)[0]:
            if rec["t"] == "intent" and any(i.get("kind") == "block" for i in rec.get("items", [])):
                yield rec


def _diff(a: dict, b: dict, n: int = 4) -> str:
    only_a = sorted(set(a) - set(b))[:n]
    only_b = sorted(set(b) - set(a))[:n]
    differ = sorted(k for k in set(a) & set(b) if a[k] != b[k])[:n]
    return f"only in result {only_a}, missing {only_b}, differing {[(k, a[k], b[k]) for k in differ]}"


def crash_campaign(work: Path, ledger: Ledger, *, kills: int, seed: int, max_trials: int | None = None,
                   scenarios: list[Scenario] | None = None) -> list[dict]:
    """Trials round-robin over the scenarios until `kills` kill points were hit."""
    benches = [CrashBench(s, work, ledger) for s in (scenarios or SCENARIOS)]
    rng = random.Random(seed)
    trials = []
    i = 0
    while ledger.counts["kill_points"] < kills and (max_trials is None or i < max_trials):
        bench = benches[i % len(benches)]
        trials.append(bench.trial(rng.randrange(2 ** 32)))
        i += 1
    return trials


# ---------------------------------------------------------------------------------------
# 2. Injected faults on real filesystems

SHIM = '''\
"""kvmigrate reliability fault shim (loaded as sitecustomize when KVM_FAULT is set)."""
import errno, os, re
_spec = os.environ.get("KVM_FAULT", "")
_kind, _, _arg = _spec.partition(":")
if _kind == "emlink":
    _real_link = os.link
    def _link(src, dst, *args, **kwargs):
        if _arg in os.fsdecode(src):
            raise OSError(errno.EMLINK, os.strerror(errno.EMLINK), src)
        return _real_link(src, dst, *args, **kwargs)
    os.link = _link
elif _kind == "enospc":
    _real_write = os.write
    _left = [int(_arg)]
    def _write(fd, data):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if re.search(r"\\.kvmigrate-[0-9]+\\.tmp$", name):
            _left[0] -= 1
            if _left[0] < 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return _real_write(fd, data)
    os.write = _write
'''


def shim_env(work: Path, fault: str) -> dict[str, str]:
    """Environment that loads the fault shim into the kvmigrate process."""
    d = work / "shim"
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text(SHIM)
    os.chmod(d, 0o755)
    os.chmod(d / "sitecustomize.py", 0o644)
    return {"PYTHONPATH": str(d), "KVM_FAULT": fault}


def sh(*cmd: Any) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True)


@contextlib.contextmanager
def mounted(*mount_args: Any, target: Path) -> Iterator[bool]:
    """`mount ... target`; yields whether it worked; always unmounts."""
    p = sh("mount", *mount_args, target)
    try:
        yield p.returncode == 0
    finally:
        if p.returncode == 0:
            for _ in range(20):
                if sh("umount", target).returncode == 0:
                    break
                time.sleep(0.1)


class FaultBench:
    """A root, its manifest and an uninterrupted reference run, for one fault case."""

    def __init__(self, work: Path, name: str, ledger: Ledger, specs: list[dict], blocks: int, mode: str,
                 separate_dest: bool = True, base: Path | None = None):
        self.name = name
        self.ledger = ledger
        self.mode = mode
        self.dir = (base or work / "faults") / name
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.facts = self.dir / "facts.json"
        self.facts.write_text(json.dumps(FACTS))
        self.root = self.dir / "root"
        build_root(self.root, specs, blocks)
        self.pristine = snapshot(self.root)
        self.sources = {e.ino: rel for rel, e in self.pristine.items() if e.kind == "file"}
        self.dest = self.dir / "dest" if separate_dest else self.root
        if separate_dest:
            self.dest.mkdir()
        ref_root = self.dir / "ref-root"
        build_root(ref_root, specs, blocks)
        ref_sources = {e.ino: rel for rel, e in snapshot(ref_root).items() if e.kind == "file"}
        ref_dest = self.dir / "ref-dest" if separate_dest else ref_root
        ref_pristine_dest = {}
        if separate_dest:
            ref_dest.mkdir()
        else:
            ref_pristine_dest = snapshot(ref_root)
        ledger.cli(f"faults/{name}/reference", "migrate", ref_root, "--facts", self.facts, "--apply",
                   "--dest", ref_dest, "--mode", mode, allowed=bits_only(0))
        ref_snap = snapshot(ref_dest)
        self.ref_new = {r: e for r, e in ref_snap.items() if r not in ref_pristine_dest}
        self.ref_norm = normalized(ref_snap, ref_sources)
        self.dest_before = snapshot(self.dest)

    def problems_after_stop(self, run: Run, expect: str) -> list[tuple[str, str]]:
        out = []
        if run.rc != 8:
            out.append(("exit_code", f"expected exit 8, got {run.rc}"))
        if expect.lower() not in (run.stderr + run.stdout).lower():
            out.append(("message", f"expected {expect!r} in the message:\n{_tail(run.stderr + run.stdout, 6)}"))
        journals = self.journal_dir or self.root
        ignore = frozenset({os.path.relpath(journals, self.dest)} if self.journal_dir else ())
        out += check_after_kill(self.root, self.dest, self.pristine, self.ref_new, journals, ignore,
                                self.dest_before)
        return out

    def problems_after_fix(self, run: Run, *, links: bool = True, resumed: bool | None = True) -> list[tuple[str, str]]:
        out = []
        if run.rc != 0:
            out.append(("not_identical", f"the rerun after fixing the condition exited {run.rc}"))
        elif resumed is not None and "--json" in run.argv:
            got = json.loads(run.stdout)["apply"]["resumed"]
            if got != resumed:
                out.append(("journal", f"the rerun resumed={got}, expected {resumed}"))
        snap = snapshot(self.dest)
        sources = self.sources if links else {}
        want = self.ref_norm if links else {r: (k, d, None) for r, (k, d, _) in self.ref_norm.items()}
        if normalized(snap, sources) != want:
            out.append(("not_identical", _diff(normalized(snap, sources), want)))
        out += [("lost_source", c) for c in source_changes(self.pristine, self.root)]
        return out

    def problems_after_rollback(self, user: str | None = None) -> list[tuple[str, str]]:
        jdir = self.root / OWN / "journals"
        journal = self.journal_dir or jdir
        self.ledger.cli(f"faults/{self.name}/rollback", "rollback", journal, user=user, allowed=bits_only(0))
        out = []
        before = {r: e.facts() for r, e in self.dest_before.items()}
        after = {r: e.facts() for r, e in snapshot(self.dest).items()}
        if after != before:
            out.append(("rollback", "rollback did not restore the destination: " + _diff(after, before)))
        out += [("lost_source", c) for c in source_changes(self.pristine, self.root)]
        return out

    journal_dir: Path | None = None

    def verdict(self, record: dict, problems: list[tuple[str, str]]) -> dict:
        for kind, detail in problems:
            self.ledger.violate(kind, f"fault {self.name}: {detail}")
        record["ok"] = not problems
        record["problems"] = [f"[{k}] {d}" for k, d in problems]
        self.ledger.counts["faults"] += 1
        return record


def _stop_line(run: Run) -> str:
    """The first line of the error message, for the report."""
    for line in (run.stderr or run.stdout).splitlines():
        if "error" in line or "failed" in line:
            return line.strip()[:300]
    return (run.stderr or run.stdout).strip().splitlines()[0][:300] if (run.stderr or run.stdout).strip() else ""


def fault_enospc(work: Path, ledger: Ledger, *, force_injected: bool = False) -> dict:
    """ENOSPC mid-run: --dest on a 256 KiB tmpfs (100 blocks of 4 KiB do not fit)."""
    fb = FaultBench(work, "ENOSPC-injected" if force_injected else "ENOSPC", ledger, [VLLM_LINK], blocks=100,
                    mode="copy")
    args = ["migrate", "--manifest", fb.dir / "m.parquet", "--apply", "--dest", fb.dest, "--mode", "copy"]
    ledger.cli("faults/ENOSPC/scan", "scan", fb.root, "-o", fb.dir / "m.parquet", "--facts", fb.facts,
               allowed=bits_only(0))
    record: dict[str, Any] = {"fault": "ENOSPC", "where": "--dest on a full filesystem, mid-run"}
    problems: list[tuple[str, str]] = []
    mount_ok = False
    if not force_injected:
        with mounted("-t", "tmpfs", "-o", "size=256k", "tmpfs", target=fb.dest) as mount_ok:
            if mount_ok:
                record["mechanism"] = "tmpfs size=256k mounted at --dest"
                stopped = ledger.cli("faults/ENOSPC/full", *args, allowed=bits_only(8))
                problems += fb.problems_after_stop(stopped, "no space left on device")
                record["created_before_stop"] = len(read_journals(fb.root).done)
                record["message"] = _stop_line(stopped)
                sh("mount", "-o", "remount,size=16m", fb.dest)
                fixed = ledger.cli("faults/ENOSPC/after-remount", *args, "--json", allowed=bits_only(0))
                problems += fb.problems_after_fix(fixed, links=False)
                problems += fb.problems_after_rollback()
    if not mount_ok:
        record["mechanism"] = "injected: os.write raises ENOSPC after 40 block writes (mount refused)" \
            if not force_injected else "injected: os.write raises ENOSPC after 40 block writes"
        stopped = ledger.cli("faults/ENOSPC/injected", *args, env=shim_env(work, "enospc:40"), allowed=bits_only(8))
        problems += fb.problems_after_stop(stopped, "no space left on device")
        record["created_before_stop"] = len(read_journals(fb.root).done)
        record["message"] = _stop_line(stopped)
        fixed = ledger.cli("faults/ENOSPC/rerun", *args, "--json", allowed=bits_only(0))
        problems += fb.problems_after_fix(fixed, links=False)
        problems += fb.problems_after_rollback()
    return fb.verdict(record, problems)


def fault_enospc_journal(work: Path, ledger: Ledger) -> dict:
    """ENOSPC where the journal itself lives: --journal and --dest on one full tmpfs."""
    fb = FaultBench(work, "ENOSPC-journal", ledger, [LLMD_COPY_PAD], blocks=60, mode="copy")
    record: dict[str, Any] = {"fault": "ENOSPC", "where": "--journal and --dest on one full filesystem"}
    problems: list[tuple[str, str]] = []
    with mounted("-t", "tmpfs", "-o", "size=256k", "tmpfs", target=fb.dest) as ok:
        if not ok:
            record["mechanism"] = "skipped: mount refused"
            ledger.notes.append("ENOSPC-journal needs a tmpfs mount; mount was refused")
            return fb.verdict(record, [])
        record["mechanism"] = "tmpfs size=256k holding --dest and --journal"
        fb.journal_dir = fb.dest / "journal.jsonl"
        args = ["migrate", fb.root, "--facts", fb.facts, "--apply", "--dest", fb.dest, "--mode", "copy",
                "--journal", fb.journal_dir]
        stopped = ledger.cli("faults/ENOSPC-journal/full", *args, allowed=bits_only(8))
        record["message"] = _stop_line(stopped)
        problems += fb.problems_after_stop(stopped, "no space left")
        sh("mount", "-o", "remount,size=16m", fb.dest)
        fixed = ledger.cli("faults/ENOSPC-journal/after-remount", *args, "--json", allowed=bits_only(0))
        # the journal sits in the destination: compare everything but it
        problems += [p for p in fb.problems_after_fix(fixed, links=False) if "journal.jsonl" not in p[1]]
        rb = ledger.cli("faults/ENOSPC-journal/rollback", "rollback", fb.journal_dir, allowed=bits_only(0))
        left = sorted(set(snapshot(fb.dest)) - {"journal.jsonl"})
        if rb.rc != 0 or left:
            problems.append(("rollback", f"rollback left {left[:4]} (exit {rb.rc})"))
    return fb.verdict(record, problems)


def fault_exdev_shm(work: Path, ledger: Ledger) -> dict:
    """EXDEV: --dest in /dev/shm (another filesystem) with the default --mode link."""
    fb = FaultBench(work, "EXDEV-shm", ledger, [VLLM_LINK, LLMD_COPY_PAD], blocks=8, mode="copy")
    shm = Path(tempfile.mkdtemp(prefix="kvm-reliability-", dir="/dev/shm"))
    record: dict[str, Any] = {"fault": "EXDEV", "where": "--dest on /dev/shm (tmpfs), sources on the work disk"}
    problems: list[tuple[str, str]] = []
    try:
        fb.dest, fb.dest_before = shm, {}
        same = os.stat(shm).st_dev == os.stat(fb.root).st_dev
        record["mechanism"] = f"st_dev {os.stat(fb.root).st_dev} vs {os.stat(shm).st_dev}"
        if same:
            ledger.notes.append("/dev/shm is on the work filesystem here: EXDEV case not exercised")
            return fb.verdict(record, [])
        args = ["migrate", fb.root, "--facts", fb.facts, "--apply", "--dest", shm]
        stopped = ledger.cli("faults/EXDEV-shm/link", *args, allowed=bits_only(8))
        record["message"] = _stop_line(stopped)
        problems += fb.problems_after_stop(stopped, "--mode copy")
        if snapshot(shm):
            problems.append(("not_identical", "--mode link wrote into another filesystem before refusing"))
        fixed = ledger.cli("faults/EXDEV-shm/auto", *args, "--mode", "auto", "--json", allowed=bits_only(0))
        problems += fb.problems_after_fix(fixed, links=False, resumed=None)
        problems += fb.problems_after_rollback()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return fb.verdict(record, problems)


def fault_exdev_bind(work: Path, ledger: Ledger) -> dict:
    """EXDEV mid-run: --dest is a bind mount of the same filesystem (same st_dev, so the
    up-front check passes, but link() refuses to cross mounts)."""
    fb = FaultBench(work, "EXDEV-bind", ledger, [LLMD_COPY_PAD, VLLM_LINK], blocks=8, mode="copy")
    record: dict[str, Any] = {"fault": "EXDEV", "where": "--dest is a bind mount of the same filesystem"}
    problems: list[tuple[str, str]] = []
    with mounted("--bind", fb.dest, target=fb.dest) as ok:
        if not ok:
            record["mechanism"] = "skipped: mount --bind refused"
            ledger.notes.append("EXDEV-bind needs mount --bind; refused")
            return fb.verdict(record, [])
        record["mechanism"] = "mount --bind DEST DEST (same st_dev, another mount)"
        args = ["migrate", fb.root, "--facts", fb.facts, "--apply", "--dest", fb.dest]
        stopped = ledger.cli("faults/EXDEV-bind/link", *args, allowed=bits_only(8))
        record["message"] = _stop_line(stopped)
        record["created_before_stop"] = len(read_journals(fb.root).done)
        problems += fb.problems_after_stop(stopped, "across filesystems")
        fixed = ledger.cli("faults/EXDEV-bind/auto", *args, "--mode", "auto", "--json", allowed=bits_only(0))
        problems += fb.problems_after_fix(fixed, links=False)
        problems += fb.problems_after_rollback()
    return fb.verdict(record, problems)


def fault_erofs(work: Path, ledger: Ledger) -> dict:
    """EROFS: --dest is a read-only bind mount; remounted read-write, the rerun finishes."""
    fb = FaultBench(work, "EROFS", ledger, [LLMD_COPY_PAD, CPP_REWRITE], blocks=8, mode="copy")
    record: dict[str, Any] = {"fault": "EROFS", "where": "--dest on a read-only mount"}
    problems: list[tuple[str, str]] = []
    with mounted("--bind", fb.dest, target=fb.dest) as ok:
        if not ok or sh("mount", "-o", "remount,ro,bind", fb.dest).returncode != 0:
            record["mechanism"] = "skipped: read-only bind mount refused"
            ledger.notes.append("EROFS needs mount --bind + remount,ro; refused")
            return fb.verdict(record, [])
        record["mechanism"] = "mount --bind DEST DEST; mount -o remount,ro,bind DEST"
        args = ["migrate", fb.root, "--facts", fb.facts, "--apply", "--dest", fb.dest, "--mode", "copy"]
        stopped = ledger.cli("faults/EROFS/ro", *args, allowed=bits_only(8))
        record["message"] = _stop_line(stopped)
        problems += fb.problems_after_stop(stopped, "read-only")
        sh("mount", "-o", "remount,rw,bind", fb.dest)
        fixed = ledger.cli("faults/EROFS/rw", *args, "--json", allowed=bits_only(0))
        problems += fb.problems_after_fix(fixed, links=False)
        problems += fb.problems_after_rollback()
    return fb.verdict(record, problems)


def fault_erofs_root(work: Path, ledger: Ledger) -> dict:
    """EROFS in place: the root itself is read-only (journal and target folders refused);
    remounted read-write, the same command finishes."""
    fb = FaultBench(work, "EROFS-root", ledger, [VLLM_LINK], blocks=8, mode="link", separate_dest=False)
    record: dict[str, Any] = {"fault": "EROFS", "where": "ROOT read-only (default journal and dest = ROOT)"}
    problems: list[tuple[str, str]] = []
    view = fb.dir / "view"
    view.mkdir()
    with mounted("--bind", fb.root, target=view) as ok:
        if not ok or sh("mount", "-o", "remount,ro,bind", view).returncode != 0:
            record["mechanism"] = "skipped: read-only bind mount refused"
            return fb.verdict(record, [])
        record["mechanism"] = "mount --bind ROOT VIEW; mount -o remount,ro,bind VIEW; migrate VIEW"
        journal = fb.dir / "journal.jsonl"
        no_journal = ledger.cli("faults/EROFS-root/journal", "migrate", view, "--facts", fb.facts, "--apply",
                                allowed=bits_only(8))
        problems += fb.problems_after_stop(no_journal, "--journal")
        args = ["migrate", view, "--facts", fb.facts, "--apply", "--journal", journal]
        stopped = ledger.cli("faults/EROFS-root/ro", *args, allowed=bits_only(8))
        record["message"] = _stop_line(no_journal) + " / then with --journal: " + _stop_line(stopped)
        if stopped.rc != 8 or "read-only" not in stopped.stderr:
            problems.append(("message", f"expected exit 8 and 'read-only':\n{_tail(stopped.stderr, 4)}"))
        sh("mount", "-o", "remount,rw,bind", view)
        fixed = ledger.cli("faults/EROFS-root/rw", *args, "--json", allowed=bits_only(0))
        problems += fb.problems_after_fix(fixed)
        fb.journal_dir = journal
        rb = ledger.cli("faults/EROFS-root/rollback", "rollback", journal, allowed=bits_only(0))
        after = {r: e.facts() for r, e in snapshot(fb.root).items()}
        if rb.rc or after != {r: e.facts() for r, e in fb.pristine.items()}:
            problems.append(("rollback", "rollback did not restore ROOT"))
    return fb.verdict(record, problems)


def _world_readable_base(work: Path) -> Path:
    """A folder uid 65534 can traverse (pytest's tmp dirs are 0700)."""
    base = work / "as-nobody"
    base.mkdir(parents=True, exist_ok=True)
    p = base
    while p != p.parent:
        if os.stat(p).st_mode & 0o005 != 0o005:
            os.chmod(p, os.stat(p).st_mode | 0o755)
        p = p.parent
    return base


def _chmod_tree(path: Path, dirs: int = 0o755, files: int = 0o644) -> None:
    for d, ds, fs in os.walk(path):
        os.chmod(d, dirs)
        for f in fs:
            os.chmod(os.path.join(d, f), files)


def fault_eacces(work: Path, ledger: Ledger) -> dict:
    """EACCES as uid 65534 (root bypasses permission bits): first the default journal
    under a root-owned ROOT, then a destination folder it may not write, mid-run."""
    base = _world_readable_base(work)
    fb = FaultBench(work, "EACCES", ledger, [LLMD_COPY_PAD, CPP_REWRITE], blocks=8, mode="copy", base=base)
    record: dict[str, Any] = {"fault": "EACCES", "where": "as uid 65534: ROOT/.kvmigrate and a folder in --dest",
                              "mechanism": "setpriv --reuid=65534 --regid=65534 --clear-groups"}
    problems: list[tuple[str, str]] = []
    _chmod_tree(fb.dir)
    os.chmod(fb.facts, 0o644)
    jdir = fb.dir / "journals"
    jdir.mkdir()
    os.chown(jdir, NOBODY, NOBODY)
    os.chown(fb.dest, NOBODY, NOBODY)
    # a fan-out folder of a block in the middle of the run, owned by root
    blocks = sorted(r for r, e in fb.ref_new.items() if e.kind == "file" and r.endswith(".bin"))
    blocked = Path(blocks[len(blocks) // 2]).parent
    for i in range(1, len(blocked.parts) + 1):
        d = fb.dest / Path(*blocked.parts[:i])
        d.mkdir(exist_ok=True)
        if i < len(blocked.parts):
            os.chown(d, NOBODY, NOBODY)
    fb.dest_before = snapshot(fb.dest)
    no_journal = ledger.cli("faults/EACCES/journal", "migrate", fb.root, "--facts", fb.facts, "--apply",
                            "--dest", fb.dest, "--mode", "copy", user="nobody", allowed=bits_only(8))
    if no_journal.rc != 8 or "--journal" not in no_journal.stderr:
        problems.append(("message", f"default journal not writable: expected exit 8 naming --journal:\n"
                                    f"{_tail(no_journal.stderr, 4)}"))
    args = ["migrate", fb.root, "--facts", fb.facts, "--apply", "--dest", fb.dest, "--mode", "copy",
            "--journal", jdir]
    stopped = ledger.cli("faults/EACCES/dest", *args, user="nobody", allowed=bits_only(8))
    record["message"] = _stop_line(stopped)
    fb.journal_dir = jdir
    record["created_before_stop"] = sum(1 for j in jdir.glob("*.jsonl") for r in parse_journal(j)[0]
                                        if r["t"] == "done" and r.get("kind") == "block")
    problems += [p for p in fb.problems_after_stop(stopped, "permission denied")]
    os.chown(fb.dest / blocked, NOBODY, NOBODY)
    fixed = ledger.cli("faults/EACCES/after-chown", *args, "--json", user="nobody", allowed=bits_only(0))
    problems += fb.problems_after_fix(fixed, links=False)
    problems += fb.problems_after_rollback(user="nobody")
    return fb.verdict(record, problems)


def fault_eperm_hardlink(work: Path, ledger: Ledger) -> dict:
    """EPERM: uid 65534 may write --dest but not hard-link root's files
    (fs.protected_hardlinks); the rerun as the files' owner finishes the run."""
    base = _world_readable_base(work)
    fb = FaultBench(work, "EPERM-link", ledger, [VLLM_LINK], blocks=8, mode="link", base=base)
    record: dict[str, Any] = {"fault": "EPERM", "where": "hard links to files another user owns",
                              "mechanism": "setpriv as uid 65534 with fs.protected_hardlinks="
                                           + Path("/proc/sys/fs/protected_hardlinks").read_text().strip()}
    problems: list[tuple[str, str]] = []
    _chmod_tree(fb.dir)
    os.chmod(fb.facts, 0o644)
    jdir = fb.dir / "journals"
    jdir.mkdir()
    os.chown(jdir, NOBODY, NOBODY)
    os.chown(fb.dest, NOBODY, NOBODY)
    fb.journal_dir = jdir
    args = ["migrate", fb.root, "--facts", fb.facts, "--apply", "--dest", fb.dest, "--journal", jdir]
    stopped = ledger.cli("faults/EPERM-link/nobody", *args, user="nobody", allowed=bits_only(8))
    record["message"] = _stop_line(stopped)
    if Path("/proc/sys/fs/protected_hardlinks").read_text().strip() != "1":
        ledger.notes.append("fs.protected_hardlinks is off: the EPERM case did not stop")
        return fb.verdict(record, [])
    problems += fb.problems_after_stop(stopped, "--mode copy")
    fixed = ledger.cli("faults/EPERM-link/as-owner", *args, "--json", allowed=bits_only(0))
    problems += fb.problems_after_fix(fixed, links=True)
    problems += fb.problems_after_rollback()
    return fb.verdict(record, problems)


def fault_emlink(work: Path, ledger: Ledger, *, real: bool) -> dict:
    """EMLINK on one source block: --mode link fails that block (exit 8, the finding
    names --mode auto); the rerun with --mode auto copies it and ends like a full run."""
    name = "EMLINK-real" if real else "EMLINK-shim"
    fb = FaultBench(work, name, ledger, [VLLM_LINK], blocks=8, mode="link")
    victim = sorted(r for r, e in fb.pristine.items() if r.endswith(".bin"))[3]
    record: dict[str, Any] = {"fault": "EMLINK", "where": f"source block {os.path.basename(victim)[:12]}..."}
    problems: list[tuple[str, str]] = []
    env: dict[str, str] = {}
    aux = fb.dir / "links"
    if real:
        aux.mkdir()
        n = 0
        try:
            while True:
                os.link(fb.root / victim, aux / str(n))
                n += 1
        except OSError as exc:
            if exc.errno != errno.EMLINK:
                raise
        record["mechanism"] = f"real: {n + 1} hard links on the source file (the filesystem's limit)"
        fb.pristine = snapshot(fb.root)
    else:
        env = shim_env(work, f"emlink:{os.path.basename(victim)}")
        record["mechanism"] = "shim: os.link raises EMLINK for the victim source (sitecustomize)"
    args = ["migrate", fb.root, "--facts", fb.facts, "--apply"]
    dest = fb.dest
    args += ["--dest", dest]
    stopped = ledger.cli(f"faults/{name}/link", *args, env=env, allowed=bits_only(8))
    record["message"] = _stop_line(stopped)
    problems += fb.problems_after_stop(stopped, "--mode auto")
    fixed = ledger.cli(f"faults/{name}/auto", *args, "--mode", "auto", "--json", allowed=bits_only(0))
    # a real EMLINK stays: the victim is a copy now (compared by bytes, the others by inode too)
    ref = fb.ref_norm
    victim_target = [r for r, v in ref.items() if v[2] == victim] if real else []
    fb.ref_norm = {r: (v if r not in victim_target else (v[0], v[1], None)) for r, v in ref.items()}
    problems += fb.problems_after_fix(fixed, links=True, resumed=False)
    fb.ref_norm = ref
    problems += fb.problems_after_rollback()
    if real:
        shutil.rmtree(aux, ignore_errors=True)
    return fb.verdict(record, problems)


def fault_campaign(work: Path, ledger: Ledger, *, real_emlink: bool = True) -> list[dict]:
    cases: list[Callable[[], dict]] = [
        lambda: fault_enospc(work, ledger),
        lambda: fault_enospc(work, ledger, force_injected=True),
        lambda: fault_enospc_journal(work, ledger),
        lambda: fault_exdev_shm(work, ledger),
        lambda: fault_exdev_bind(work, ledger),
        lambda: fault_erofs(work, ledger),
        lambda: fault_erofs_root(work, ledger),
        lambda: fault_eacces(work, ledger),
        lambda: fault_eperm_hardlink(work, ledger),
        lambda: fault_emlink(work, ledger, real=False),
    ]
    if real_emlink:
        cases.append(lambda: fault_emlink(work, ledger, real=True))
    return [case() for case in cases]


# ---------------------------------------------------------------------------------------
# 3. A live engine writing, loading and evicting while scan and migrate run

ENGINE_SIM = REPO / "tests" / "engine_sim.py"
INTEGRITY = {"replica_mismatch", "size_mismatch", "short", "zero_filled", "misfiled", "header_invalid",
             "digest_mismatch", "config_invalid"}  # interface.md §2, bit 4


class Engines:
    """One engine_sim process per deployment, started on a root and stopped with SIGTERM."""

    def __init__(self, root: Path, specs: list[dict], logs: Path, seed: int, evict_slack: int = 8):
        self.specs = [{**GEOMETRY, **s} for s in specs]
        self.logs = [logs / f"engine-{i}.jsonl" for i in range(len(specs))]
        self.procs = []
        for i, spec in enumerate(self.specs):
            nfiles = sum(1 for _ in engine_sim.Engine(str(root), [spec], os.devnull, 0, None).known)
            self.procs.append(subprocess.Popen(
                [sys.executable, str(ENGINE_SIM), str(root), "--spec", json.dumps(spec), "--log", str(self.logs[i]),
                 "--seed", str(seed + i), "--duration", "120", "--evict-above", str(nfiles + evict_slack)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE))

    def wait_for_writes(self, n: int, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            counts = [sum(1 for r in self._records(i) if r["op"] == "write") for i in range(len(self.procs))]
            if min(counts) >= n:
                return
            time.sleep(0.02)

    def _records(self, i: int) -> list[dict]:
        return engine_sim.read_log(str(self.logs[i])) if self.logs[i].exists() else []

    def stop(self) -> list[str]:
        errors = []
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=60)
            if p.returncode != 0:
                errors.append(f"engine {i} exited {p.returncode}: {err.decode()[-500:]}")
        return errors

    def records(self) -> list[dict]:
        return [dict(r, engine=i) for i in range(len(self.procs)) for r in self._records(i)]


def _hex_of(rel: str) -> str:
    return os.path.basename(rel).split(".")[0]


def engine_round(work: Path, ledger: Ledger, seed: int, *, verify: str, blocks: int = 12) -> dict:
    """Three engines (vLLM, llm-d, vllm.cpp) write, load and evict on one root while
    `scan --verify hash` and then `migrate --apply` run on it."""
    d = work / "engine" / f"round-{seed}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    facts = d / "facts.json"
    facts.write_text(json.dumps(FACTS))
    root = d / "root"
    specs = [VLLM_LINK, LLMD_COPY_PAD, CPP_REWRITE]
    build_root(root, specs, blocks)
    pristine = snapshot(root)
    pristine_bytes = {rel: (root / rel).read_bytes() for rel, e in pristine.items() if e.kind == "file"}
    record: dict[str, Any] = {"seed": seed, "verify": verify, "engines": ["vLLM", "llm-d", "vllm.cpp"]}
    problems: list[tuple[str, str]] = []
    engines = Engines(root, specs, d, seed)
    try:
        engines.wait_for_writes(15)
        scan = ledger.cli("engine/scan", "scan", root, "-o", d / "live.parquet", "--verify", "hash", "--facts", facts,
                          allowed=lambda rc: rc & ~(1 | 4) == 0)
        migrate = ledger.cli("engine/migrate", "migrate", root, "--facts", facts, "--apply", "--json",
                             "--verify", verify, allowed=lambda rc: rc & ~(1 | 4) == 0)
    finally:
        problems += [("engine", e) for e in engines.stop()]
    log = engines.records()
    writes = {r["path"]: r for r in log if r["op"] == "write"}
    deleted = {r["path"] for r in log if r["op"] == "delete"}
    bad_hexes = {r["hex"] for r in writes.values() if not r["ok"]}
    record["engine_ops"] = dict(Counter(r["op"] if r["op"] != "delete" else f"delete ({r['why']})" for r in log
                                        if r["op"] not in ("start", "stop")))

    # scan: no false finding (integrity states only on what an engine wrote wrong)
    if scan.rc >= 0 and (d / "live.parquet").exists():
        from kvmigrate import manifest
        rows = manifest.read_table(str(d / "live.parquet"), columns=["relpath", "status", "reason"]).to_pylist()
        record["scan_rows"] = len(rows)
        record["scan_status"] = dict(Counter(r["status"] for r in rows))
        for r in rows:
            if r["status"] in INTEGRITY | {"unreadable"} and _hex_of(r["relpath"]) not in bad_hexes:
                problems.append(("false_finding", f"scan: {r['relpath']} {r['status']}: {r['reason']}"))
    # migrate: every created file holds what its source held; nothing lost or unaccounted
    view = read_journals(root)
    outcomes = json.loads(migrate.stdout)["outcomes"] if migrate.rc >= 0 and migrate.stdout.strip() else {}
    record["migrate_outcomes"] = outcomes

    def source_bytes(rel: str) -> bytes | None:
        if rel in pristine_bytes:
            return pristine_bytes[rel]
        w = writes.get(rel)
        if w is None:
            return None
        return engine_sim.block_bytes(engines.specs[w["engine"]], w["base"], w["hex"], w["group"], w["rank"],
                                      short=not w["ok"])

    created = 0
    for rel, rec in view.done.items():
        if rec.get("kind") != "block":
            continue
        created += 1
        item = view.intents.get(rel, {})
        src = source_bytes(item.get("src", ""))
        got = (root / rel).read_bytes() if (root / rel).is_file() else None
        if src is None or got is None:
            problems.append(("clobbered", f"{rel}: created from {item.get('src')} but {'source' if src is None else 'file'}"
                                          " is unknown"))
            continue
        why = _output_mismatch(rec.get("action") or item.get("action"), src, got, view.targets.get(item.get("base"), {}),
                               _hex_of(rel), int(rel.split("/")[-2].split("_g")[1]))
        if why:
            problems.append(("clobbered", f"{rel} (from {item.get('src')}): {why}"))
    for rel, item in view.intents.items():
        if item.get("kind") == "block" and rel not in view.done and rel not in view.skips:
            problems.append(("lost_block", f"{rel}: planned from {item.get('src')}, neither created nor reported"))
    targets = {t for t in view.targets}
    for rel, e in snapshot(root).items():
        top = rel.split("/")[0]
        if top.rsplit("_r", 1)[0] in targets and e.kind == "file" and rel.endswith(".bin") and rel not in view.done:
            problems.append(("clobbered", f"{rel}: a file in a target namespace no done record accounts for"))
        if TMP_RE.search(rel) or rel.endswith(layout.LOCK_NAME):
            problems.append(("not_identical", f"{rel}: kvmigrate temp or lock file left behind"))
    # sources: unchanged, or deleted by an engine
    for rel, e in pristine.items():
        if e.kind == "file" and rel not in deleted:
            if source_changes({rel: e}, root):
                problems.append(("lost_source", f"{rel}: changed although no engine deleted it"))
    record["created"] = created
    record["changed_since_scan"] = sum(1 for s in view.skips.values() if s.get("outcome") == "changed_since_scan")
    for kind, detail in problems:
        ledger.violate(kind, f"engine round {seed}: {detail}")
    record["ok"] = not problems
    ledger.counts["engine_rounds"] += 1
    ledger.counts["engine_writes"] += len(writes)
    ledger.counts["engine_deletes"] += len(deleted)
    return record


def _output_mismatch(action: str | None, src: bytes, got: bytes, target: dict, hex_hash: str, group: int) -> str | None:
    """Why a created file is not what its action makes of the source bytes (None if it is)."""
    if action == "link":
        return None if got == src else "a linked block differs from its source"
    if action == "copy_pad":
        return None if got == src + bytes(-len(src) % 4096) else "not the source + zero pad to 4096"
    if action == "rewrite_header":
        if got[vllmcpp.HEADER_SIZE:] != src[vllmcpp.HEADER_SIZE:]:
            return "payload differs from the source's"
        failed = vllmcpp.verify_header(got[:vllmcpp.HEADER_SIZE], digest=bytes.fromhex(target.get("digest", "")),
                                       payload_size=target.get("payload_size") or len(src) - vllmcpp.HEADER_SIZE,
                                       key=vllmcpp.make_key(bytes.fromhex(hex_hash), group))
        return f"header check {failed} fails for the target identity" if failed else None
    return f"unexpected action {action!r}"


def engine_campaign(work: Path, ledger: Ledger, *, rounds: int, seed: int) -> list[dict]:
    return [engine_round(work, ledger, seed + i, verify=("hash", "size")[i % 2]) for i in range(rounds)]
