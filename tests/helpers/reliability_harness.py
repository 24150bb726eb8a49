"""The reliability campaign's benches and oracles, shared by tests/reliability/test_reliability_*.py
(CI-sized) and scripts/reliability.py (the full campaign and its report).

A bench drives the `kvmigrate` executable on synth trees (kills it, injects faults, runs
a live engine beside it, builds hostile roots); an oracle judges the outcome on its own
terms: an independent journal reader, tree snapshots compared by bytes and inodes, the
bytes each transform must write, and every command's exit code and message (`Ledger`).
What each part checks is in scripts/reliability.py's docstring; migration.md §3 is the
rule book.
"""


from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from kvmigrate import layout
from kvmigrate.formats import vllmcpp
from kvmigrate.migrate.apply import CRASH_ENV
from kvmigrate.synth import SynthSpec, build

from helpers import engine_sim  # tests/helpers/engine_sim.py

REPO = Path(__file__).resolve().parents[2]  # tests/helpers/ -> the repository

KVMIGRATE = str(Path(sys.executable).with_name("kvmigrate")) if Path(sys.executable).with_name(
    "kvmigrate").exists() else (shutil.which("kvmigrate") or "kvmigrate")
NOBODY = 65534
SETPRIV = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
OWN = layout.OWN_DIR
TMP_RE = layout.OWN_TMP_RE
GEOMETRY = dict(layers=2, page_bytes=256)
FACTS = {"org/full-model": {"kv_kind": "full", "total_kv_heads": 8, "model_dtype": "bfloat16", "writer_tp": 1,
                            "writer_pp": 1},
         "org/mla-model": {"kv_kind": "mla", "model_dtype": "bfloat16"},
         "org/cpp-model": {"kv_kind": "mla", "model_dtype": "bfloat16"}}
def facts_of(specs) -> dict:
    """FACTS for the models of these specs only (and "*"): a key no namespace of the root
    uses is a usage error."""
    models = {spec.get("model_name") for spec in specs if isinstance(spec, dict)}
    return {k: v for k, v in FACTS.items() if k == "*" or k in models}


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


def observed(snap: dict[str, Entry]) -> dict[str, tuple]:
    """What reading or writing would change: folders by kind (listing one may move its
    atime), the rest by inode, size, mtime, mode and content, regular files by atime too
    (reading a symlink moves the link's own atime, not its target's)."""
    return {r: (e.facts(), e.atime_ns if e.kind == "file" else None) for r, e in snap.items()}


def backdate_atimes(top: Path, days: float = 3) -> None:
    """Move every file's atime back, so any read without O_NOATIME moves it (relatime
    updates an atime older than a day)."""
    for d, _, fs in os.walk(top):
        for f in fs:
            p = os.path.join(d, f)
            st = os.lstat(p)
            os.utime(p, ns=(st.st_atime_ns - int(days * 86400e9), st.st_mtime_ns), follow_symlinks=False)


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
        return sorted(d.glob("*.journal"))
    return sorted(where.glob("*.journal")) if where.is_dir() else []


def parse_journal(path: Path) -> tuple[list[dict], list[str]]:
    """Records and problems: every complete line must be a JSON object with a type, the
    first a header; only the last line (format 2: frame) may be torn (a kill mid-write)."""
    data = path.read_bytes()
    if data[:4] == b"KVJF":
        return _parse_frames(path, data)
    problems = []
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


def _parse_frames(path: Path, data: bytes) -> tuple[list[dict], list[str]]:
    """Format 2: `KVJF` u32 length u32 crc32, a zlib payload of JSON lines; only the last
    frame may be cut short. `linked` records become one `done` per link (from the
    intent frame at byte offset `at`: path, inode, dev, size, action; mtimes as deltas)."""
    problems, records = [], []
    intents: dict[int, list] = {}
    pos = 0
    while pos < len(data):
        if len(data) - pos < 12:
            break  # a torn frame header
        magic, length, crc = struct.unpack_from("<4sII", data, pos)
        payload = data[pos + 12:pos + 12 + length]
        if magic != b"KVJF":
            problems.append(f"{path.name}: no frame at byte {pos}")
            break
        if len(payload) < length:
            break  # the torn last frame
        if zlib.crc32(payload) != crc:
            if pos + 12 + length < len(data):
                problems.append(f"{path.name}: frame at byte {pos} fails its CRC and is not the last")
            break
        for i, line in enumerate(zlib.decompress(payload).splitlines()):
            rec = json.loads(line)
            if not isinstance(rec, dict) or "t" not in rec:
                problems.append(f"{path.name}: frame at byte {pos}, line {i + 1} has no record type")
                continue
            if rec["t"] == "intent":
                intents[pos] = rec["items"]
            if rec["t"] == "linked":
                items, mtime, k = intents[rec["at"]], 0, 0
                for start, count in rec["i"]:
                    for item in items[start:start + count]:
                        mtime += rec["mtime_ns"][k]
                        done = {"t": "done", "kind": "block", "path": item["path"], "ino": item["ino"],
                                "dev": item["dev"], "size": item["size"], "mtime_ns": mtime, "how": "link",
                                "action": item["action"]}
                        if rec["xxh3_128"][k]:
                            done["xxh3_128"] = rec["xxh3_128"][k]
                        records.append(done)
                        k += 1
                continue
            records.append(rec)
        pos += 12 + length
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
                elif r.get("kind") == "dir":  # a folder a resumed run proved its predecessor made
                    view.dirs_done.add(r["path"])
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
        # a link's record may prove it by (inode, size, mtime) instead of an output hash
        if (e.ino != rec.get("ino") or e.size != rec.get("size")
                or ("mtime_ns" in rec and e.mtime_ns != rec["mtime_ns"])
                or ("xxh3_128" in rec and xxh_file(str(dest / rel)) != rec["xxh3_128"])
                or not ({"xxh3_128", "mtime_ns"} & set(rec))):
            out.append(("journal", f"done record for {rel} does not match the file (inode, size, mtime or hash)"))
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
        self.facts.write_text(json.dumps(facts_of(scn.specs)))
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
                        allowed=bits_only(1))  # pending work

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

    def trial(self, seed: int, *, via: str | None = None, kills: int | None = None,
              how: str | None = None) -> dict[str, Any]:
        """One randomized trial: kill (once or twice), check, rerun, verify, rollback.
        `via`, `kills` and `how` pin what the seed would otherwise choose (tests)."""
        rng = random.Random(seed)
        scn = self.scn
        via = via or ("manifest" if rng.random() < 0.7 else "scan")
        kills = kills or (2 if rng.random() < 0.2 else 1)
        forced_how = how
        record: dict[str, Any] = {"scenario": scn.name, "seed": seed, "via": via, "kills": []}
        problems: list[tuple[str, str]] = []
        for _ in range(kills):
            how = forced_how or ("hook" if rng.random() < 0.65 else "delay")
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
            record["kills"].append({"how": how, "at": where, "killed": killed,
                                    "blocks_done": sum(1 for r in read_journals(self.root).done.values()
                                                       if r.get("kind") == "block"),
                                    "blocks_total": self.hits["created"]})
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
        else:  # the run's links and the rollback's unlinks moved the sources' ctimes, and their journals
            # (what tells kvmigrate it moved them) are gone: the size manifest no longer proves them
            self.ledger.cli(f"{run_label}/rescan", "scan", self.root, "-o", self.manifest, "--facts", self.facts,
                            allowed=bits_only(1))
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
        self.facts.write_text(json.dumps(facts_of(specs)))
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
            return line.strip()[:1000]
    return (run.stderr or run.stdout).strip().splitlines()[0][:1000] if (run.stderr or run.stdout).strip() else ""


def fault_enospc(work: Path, ledger: Ledger, *, force_injected: bool = False) -> dict:
    """ENOSPC mid-run: --dest on a 256 KiB tmpfs (100 blocks of 4 KiB do not fit)."""
    fb = FaultBench(work, "ENOSPC-injected" if force_injected else "ENOSPC", ledger, [VLLM_LINK], blocks=100,
                    mode="copy")
    args = ["migrate", "--manifest", fb.dir / "m.parquet", "--apply", "--dest", fb.dest, "--mode", "copy"]
    ledger.cli("faults/ENOSPC/scan", "scan", fb.root, "-o", fb.dir / "m.parquet", "--facts", fb.facts,
               allowed=bits_only(1))  # pending work
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
        problems += fb.problems_after_stop(no_journal, "remount it read-write")  # --journal alone would not help
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
    for d, _ds, fs in os.walk(path):
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
    record["created_before_stop"] = sum(1 for j in jdir.glob("*.journal") for r in parse_journal(j)[0]
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


# ---------------------------------------------------------------------------------------
# 3. A live engine writing, loading and evicting while scan and migrate run

ENGINE_SIM = REPO / "tests" / "helpers" / "engine_sim.py"
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
    root = d / "root"
    specs = [VLLM_LINK, LLMD_COPY_PAD, CPP_REWRITE]
    facts.write_text(json.dumps(facts_of(specs)))
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
        if e.kind == "file" and rel not in deleted and source_changes({rel: e}, root):
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


# ---------------------------------------------------------------------------------------
# 4. Hostile and broken input (hypothesis)

HOSTILE_SPECS = {"vllm": VLLM_LINK, "llmd": LLMD_COPY_PAD, "vllmcpp": CPP_REWRITE,
                 "vllm-S2": {"family": "vllm", "scheme": "S2", "tp": 1, "model_name": "org/full-model"}}
HOSTILE_FACTS = {**FACTS, "*": {"kv_kind": "full", "total_kv_heads": 8, "model_dtype": "bfloat16"}}
EVIL_MODEL_NAMES = ["..", "../../outside", "a/../../b", "/etc/passwd", ".kvmigrate", "x" * 300, "evil\ud800name",
                    "nul\x00byte", "new\nline", "ünïcødé/模型", "back\\slash", "-rf", "$(touch pwned)", " ", "",
                    "<script>alert(1)</script>"]
HTML_INJECTION = "<script>alert(1)</script>"
CONFIG_KINDS = ("garbage", "not_object", "deep", "huge", "wrong_type", "unknown_keys", "evil_model_name", "empty",
                "utf16", "non_utf8", "symlink_out", "fifo", "directory", "sparse")
ITEM_KINDS = ("dotdot_name", "binary_name", "symlink_loop", "symlink_out_file", "symlink_out_dir", "symlink_dotdot",
              "fifo", "chardev", "blockdev", "empty_block", "sparse_block", "garbage_block", "deep_dirs",
              "file_as_dir", "long_name")
PLACES = ("root", "base", "rank", "bucket", "fanout")
TRAPS = ("base", "rank", "config", "bucket")  # symlinks planted where migrate will write


def hostile_recipes():
    """A hypothesis strategy of JSON-able recipes for `build_hostile`."""
    from hypothesis import strategies as st

    json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                          st.text(max_size=20))
    json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                   st.dictionaries(st.text(max_size=8), inner,
                                                                                   max_size=3)), max_leaves=8)
    config = st.fixed_dictionaries({
        "ns": st.integers(0, 3),
        "kind": st.sampled_from(CONFIG_KINDS),
        "garbage": st.binary(max_size=64).map(bytes.hex),
        "value": json_value,
        "depth": st.sampled_from([100, 3000, 200_000]),
        "mib": st.integers(1, 3),
        "key": st.integers(0, 40),
        "model": st.sampled_from(EVIL_MODEL_NAMES),
        "rename": st.booleans(),
    })
    item = st.fixed_dictionaries({
        "kind": st.sampled_from(ITEM_KINDS),
        "place": st.sampled_from(PLACES),
        "ns": st.integers(0, 3),
        "name": st.binary(min_size=1, max_size=24).filter(lambda b: b"/" not in b and b"\0" not in b
                                                          and b not in (b".", b"..")).map(bytes.hex),
        "hex": st.binary(min_size=32, max_size=32).map(bytes.hex),
        "depth": st.integers(5, 60),
    })
    return st.fixed_dictionaries({
        "namespaces": st.lists(st.sampled_from(sorted(HOSTILE_SPECS)), min_size=1, max_size=3, unique=True),
        "blocks": st.integers(3, 5),
        "configs": st.lists(config, max_size=4),
        "items": st.lists(item, max_size=8),
        "traps": st.lists(st.fixed_dictionaries({"at": st.sampled_from(TRAPS), "ns": st.integers(0, 3),
                                                 "to": st.sampled_from(["marker", "dir", "loop"])}), max_size=2),
        "hash_scan": st.booleans(),
    })


def _digest_name(fields: Any) -> str | None:
    """The base folder name a writer would use for these fields (None if not computable)."""
    from kvmigrate.identity import canonical

    if not isinstance(fields, dict) or not isinstance(fields.get("model_name"), str):
        return None
    cpp = all(k in fields for k in ("format_version", "hash_algo", "kv_cache_spec_kind"))
    try:
        return layout.base_name(fields["model_name"], canonical.d12(fields, "vllmcpp" if cpp else "vllm"))
    except (ValueError, TypeError):
        return None


def _rename_namespace(root: Path, base: str, new: str) -> str:
    """Rename a base folder and its rank folders (so config.json hashes to its folder)."""
    if not new or "\0" in new or len(new.encode("utf-8", "surrogatepass")) > 250 or new == base:
        return base
    try:
        os.rename(root / base, root / new)
        for p in list(root.iterdir()):
            if p.name.startswith(base + "_r") and p.name[len(base) + 2:].isdigit():
                os.rename(p, root / (new + p.name[len(base):]))
    except (OSError, UnicodeError, ValueError):
        return base
    return new


def build_hostile(root: Path, outside: Path, recipe: dict) -> dict[str, Any]:
    """Build a hostile root from a recipe; returns what it made (namespaces by base name)."""
    root.mkdir(parents=True)
    bases: list[str] = []
    for key in recipe["namespaces"]:
        spec = SynthSpec(**{**GEOMETRY, "blocks": recipe["blocks"], **HOSTILE_SPECS[key]})
        res = build(root, spec)
        bases += [ns["base_name"] for ns in res.namespaces]
    made = Counter()
    marker = outside / "marker"
    for cfg in recipe["configs"]:
        if not bases:
            break
        i = cfg["ns"] % len(bases)
        base = bases[i]
        path = root / base / "config.json"
        if not path.is_file() or path.is_symlink() or path.stat().st_size > 64 << 20:
            continue  # an earlier mutation made it a FIFO, folder, link or 1 TiB sparse file
        try:
            fields = json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError):
            fields = None
        kind = cfg["kind"]
        made[f"config:{kind}"] += 1
        data: bytes | None = None
        new_fields = None
        if kind == "garbage":
            data = bytes.fromhex(cfg["garbage"])
        elif kind == "not_object":
            data = json.dumps(cfg["value"] if not isinstance(cfg["value"], dict) else [cfg["value"]]).encode()
        elif kind == "deep":
            n = cfg["depth"]
            data = (("[" * n + "]" * n) if n % 2 == 0 else ('{"a":' * n + "1" + "}" * n)).encode()
        elif kind == "huge" and isinstance(fields, dict):
            new_fields = {**fields, "padding": "x" * (cfg["mib"] << 20)}
        elif kind == "wrong_type" and isinstance(fields, dict) and fields:
            key = sorted(fields)[cfg["key"] % len(fields)]
            new_fields = {**fields, key: cfg["value"]}
        elif kind == "unknown_keys" and isinstance(fields, dict):
            new_fields = {**fields, **(cfg["value"] if isinstance(cfg["value"], dict) else {"extra": cfg["value"]})}
        elif kind == "evil_model_name" and isinstance(fields, dict):
            new_fields = {**fields, "model_name": cfg["model"]}
        elif kind == "empty":
            data = b""
        elif kind == "utf16" and fields is not None:
            data = json.dumps(fields).encode("utf-16")
        elif kind == "non_utf8" and isinstance(fields, dict):
            data = json.dumps({**fields, "model_name": "MODEL"}).encode().replace(b"MODEL", b"m\xff\xfeodel")
        elif kind in ("symlink_out", "fifo", "directory", "sparse"):
            path.unlink()
            if kind == "symlink_out":
                os.symlink(outside / "ns" / "config.json", path)
            elif kind == "fifo":
                os.mkfifo(path)
            elif kind == "directory":
                path.mkdir()
            else:
                with open(path, "wb") as f:
                    f.truncate(1 << 40)
            continue
        if new_fields is not None:
            data = json.dumps(new_fields, indent=2, sort_keys=True).encode("utf-8", "surrogatepass")
        if data is None:
            continue
        path.write_bytes(data)
        if cfg["rename"] and new_fields is not None:
            bases[i] = _rename_namespace(root, base, _digest_name(new_fields) or base)
    for it in recipe["items"]:
        made[f"item:{it['kind']}"] += 1
        where = _place(root, bases, it)
        try:
            where.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # an earlier item put a file or link there
            made["item-skipped"] += 1
            continue
        _make_item(where, outside, it, marker)
    return {"bases": bases, "made": made}


def _place(root: Path, bases: list[str], it: dict) -> Path:
    """The folder an item goes into: the root, or a namespace's base, rank, bucket or fan-out folder."""
    if it["place"] == "root" or not bases:
        return root
    base = bases[it["ns"] % len(bases)]
    if it["place"] == "base":
        return root / base
    ranks = sorted(p for p in root.iterdir() if p.name.startswith(base + "_r") and p.is_dir()
                   and not p.is_symlink())
    if not ranks:
        return root / base
    rank = ranks[it["ns"] % len(ranks)]
    h = it["hex"]
    if it["place"] == "rank":
        return rank
    if it["place"] == "bucket":
        return rank / h[:3]
    return rank / h[:3] / f"{h[3:5]}_g0"


def _new_file(path: Path, data: bytes) -> None:
    """Create a file that does not exist yet (never opens a FIFO or follows a link an
    earlier item left at that name: FileExistsError instead)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _make_item(where: Path, outside: Path, it: dict, marker: Path) -> None:
    kind, h = it["kind"], it["hex"]
    block_name = f"{h}.bin"
    bwhere = os.fsencode(where)
    try:
        if kind == "dotdot_name":
            for name in ("..bin", "a..b", "...", f"..{h[:6]}.bin", ".._0123456789ab"):
                _new_file(where / name, b"..")
            (where / ".._0123456789ab_r0").mkdir(exist_ok=True)
        elif kind == "binary_name":
            fd = os.open(os.path.join(bwhere, bytes.fromhex(it["name"])),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644)
            os.write(fd, b"binary name")
            os.close(fd)
        elif kind == "symlink_loop":
            os.symlink("loop-b", where / "loop-a")
            os.symlink("loop-a", where / "loop-b")
            os.symlink(".", where / f"{h[:6]}.bin")
        elif kind == "symlink_out_file":
            os.symlink(marker, where / block_name)
        elif kind == "symlink_out_dir":
            os.symlink(outside / "ns", where / f"{h[:3]}")
        elif kind == "symlink_dotdot":
            os.symlink(os.path.relpath(marker, where), where / f"rel-{h[:8]}.bin")
        elif kind == "fifo":
            os.mkfifo(where / block_name)
        elif kind == "chardev":
            os.mknod(where / block_name, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        elif kind == "blockdev":
            os.mknod(where / block_name, 0o600 | stat.S_IFBLK, os.makedev(7, 200))
        elif kind == "empty_block":
            _new_file(where / block_name, b"")
        elif kind == "sparse_block":
            _new_file(where / block_name, b"")
            os.truncate(where / block_name, 1 << 40)
        elif kind == "garbage_block":
            _new_file(where / block_name, bytes.fromhex(it["name"]) * 7)
        elif kind == "deep_dirs":
            p = where / "deep"
            for i in range(it["depth"]):
                p = p / f"{i:03x}"
            p.mkdir(parents=True, exist_ok=True)
            _new_file(p / block_name, b"deep")
        elif kind == "file_as_dir":
            with contextlib.suppress(FileExistsError):
                _new_file(where / h[:3], b"a file where a folder belongs")
            _new_file(where / f"{h[:12]}_{h[12:24]}_r1", b"a file named like a rank folder")
        elif kind == "long_name":
            _new_file(where / ("n" * 251 + ".bin"), b"long")
    except FileExistsError:
        pass


def _outside_tree(outside: Path) -> None:
    """What links out of the root point at: a marker file and a valid namespace."""
    outside.mkdir(parents=True)
    (outside / "marker").write_bytes(b"outside the root: never read, never written\n")
    build_root(outside / "ns-root", [VLLM_LINK], 2)
    base = next(p for p in (outside / "ns-root").iterdir() if not p.name.endswith("_r0"))
    os.rename(base, outside / "ns")


def hostile_trial(work: Path, ledger: Ledger, recipe: dict, index: int) -> dict:
    """Build one hostile root and run scan, audit, migrate (dry run, --apply), verify and
    rollback on it: no traceback, documented exit bits, nothing outside touched."""
    d = work / "hostile" / f"case-{index}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    root, outside, tmp = d / "root", d / "outside", d / "tmp"
    tmp.mkdir()
    _outside_tree(outside)
    facts = d / "facts.json"
    built = build_hostile(root, outside, recipe)
    models = {HOSTILE_SPECS[key].get("model_name") for key in recipe["namespaces"]}
    facts.write_text(json.dumps({k: v for k, v in HOSTILE_FACTS.items() if k == "*" or k in models}))
    backdate_atimes(root)
    backdate_atimes(outside)
    outside_before = snapshot(outside)
    root_before = snapshot(root)
    d_before = set(os.listdir(d))
    env = {"TMPDIR": str(tmp)}
    label = f"hostile/case-{index}"
    ok = bits_only()
    runs = [ledger.cli(f"{label}/scan", "scan", root, "-o", d / "m.parquet", "--facts", facts, env=env,
                       timeout=120, allowed=ok, cwd=str(d))]
    if recipe["hash_scan"]:  # (a sparse block is nothing but holes: zero_filled, never read)
        runs.append(ledger.cli(f"{label}/scan-hash", "scan", root, "-o", d / "mh.parquet", "--verify", "hash",
                               "--facts", facts, env=env, timeout=120, allowed=ok, cwd=str(d)))
    runs.append(ledger.cli(f"{label}/audit", "audit", root, "--facts", facts, env=env, timeout=120, allowed=ok,
                           cwd=str(d)))
    if (d / "m.parquet").exists():
        runs.append(ledger.cli(f"{label}/report-html", "report", d / "m.parquet", "--format", "html", "-o",
                               d / "report.html", env=env, timeout=120, allowed=ok, cwd=str(d)))
    dry = ledger.cli(f"{label}/migrate-dry", "migrate", root, "--facts", facts, "--json", env=env, timeout=120,
                     allowed=ok, cwd=str(d))
    runs.append(dry)
    problems: list[tuple[str, str]] = []
    if observed(snapshot(root)) != observed(root_before):
        problems.append(("outside_write", "a command before --apply changed the root (or a file's atime): "
                         + _diff(observed(snapshot(root)), observed(root_before))))
    traps = _plant_traps(root, outside, recipe["traps"], dry)
    built["made"].update(f"trap:{t}" for t in traps)
    root_before = snapshot(root)
    apply = ledger.cli(f"{label}/migrate-apply", "migrate", root, "--facts", facts, "--apply", "--json", env=env,
                       timeout=120, allowed=ok, cwd=str(d))
    runs.append(apply)
    view = read_journals(root)
    journaled = set(view.targets) | {p.split("/")[0] for p in (*view.intents, *view.done)}
    allowed_tops = {OWN} | journaled | {f"{b}_r{n}" for b in journaled for n in range(64)}
    for rel, _e in snapshot(root, exclude_top=()).items():
        if rel not in root_before and rel.split("/")[0] not in allowed_tops:
            problems.append(("outside_write", f"migrate created {rel!r} outside the target namespaces"))
    for rel in source_changes(root_before, root):
        problems.append(("lost_source", rel))
    if journal_paths(root):
        jdir = root / OWN / "journals"
        ledger.cli(f"{label}/verify", "verify", root, "--journal", jdir, env=env, timeout=120, allowed=ok, cwd=str(d))
        ledger.cli(f"{label}/rollback", "rollback", jdir, env=env, timeout=120, allowed=bits_only(0), cwd=str(d))
        after = {r: e.facts() for r, e in snapshot(root).items()}
        if after != {r: e.facts() for r, e in root_before.items()}:
            problems.append(("rollback", _diff(after, {r: e.facts() for r, e in root_before.items()})))
    # outside the root: the marker and the namespace there are untouched, atime included
    outside_after = observed(snapshot(outside))
    if outside_after != observed(outside_before):
        problems.append(("followed_link", "outside the root changed (or a file there was read): "
                         + _diff(outside_after, observed(outside_before))))
    html = d / "report.html"
    if html.exists() and HTML_INJECTION in html.read_text(errors="replace"):
        problems.append(("html_injection", "a model name's <script> reached the HTML report unescaped"))
    extra = set(os.listdir(d)) - d_before - {"m.parquet", "mh.parquet", "report.html"}
    if extra or os.listdir(tmp):
        problems.append(("outside_write", f"files left next to the root: {sorted(extra)} / in TMPDIR: "
                                          f"{os.listdir(tmp)[:5]}"))
    for kind, detail in problems:
        ledger.violate(kind, f"{label} {json.dumps(recipe)[:1500]}: {detail}")
    ledger.counts["fuzzed_trees"] += 1
    for k, v in built["made"].items():
        ledger.counts[f"fuzz:{k}"] += v
    record = {"case": index, "ok": not problems, "exit_codes": [r.rc for r in runs], "made": dict(built["made"])}
    if problems:
        record["recipe"] = recipe
    if not problems:
        _rmtree_hostile(d)
    return record


def _plant_traps(root: Path, outside: Path, traps: list[dict], dry: Run) -> list[str]:
    """Symlinks where migrate --apply is about to write (target base, rank or bucket
    folder, target config.json), pointing out of the root."""
    try:
        targets = [t for t in json.loads(dry.stdout).get("targets", []) if t.get("target_base")]
    except ValueError:
        return []
    planted = []
    for trap in traps:
        if not targets:
            break
        t = targets[trap["ns"] % len(targets)]
        base, rank_dir = t["target_base"], t.get("rank_dir") or f"{t['target_base']}_r0"
        to = {"marker": outside / "marker", "dir": outside / "ns", "loop": Path("loop")}[trap["to"]]
        at = {"base": root / base, "rank": root / rank_dir, "config": root / base / "config.json",
              "bucket": root / rank_dir / "abc"}[trap["at"]]
        try:
            if at.parent != root:
                at.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(to, at)
            planted.append(trap["at"])
        except (FileExistsError, NotADirectoryError):
            pass
    return planted


def _rmtree_hostile(d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# 5. Prune, restore, purge (issue 19): kill -9 at every step, then rerun

PRUNE_SPECS = [VLLM_LINK, LLMD_COPY_PAD, CPP_REWRITE]
# step -> its kill points (KVMIGRATE_CRASH_AT) and how many times each can be hit at most
PRUNE_POINTS = {"prune": ("prune_intent", "prune_move", "prune_dirs"), "restore": ("restore",), "purge": ("purge",)}


def prune_files(root: Path) -> dict[str, tuple[int, str]]:
    """(inode, SHA-256) of every file outside .kvmigrate/."""
    out = {}
    for d, dirs, files in os.walk(root):
        if os.path.relpath(d, root) == ".":
            dirs[:] = [x for x in dirs if x != OWN]
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = (os.lstat(p).st_ino, sha256_file(p))
    return out


def prune_where(root: Path, legacy: dict[str, tuple[int, str]]) -> tuple[Counter, list[str]]:
    """Where each legacy file is (home / quarantine) and what is wrong: a file with no
    name left holding its inode and bytes is lost; two names, half-moved."""
    quarantined: dict[str, list[Path]] = {}
    qroot = root / OWN / "quarantine"
    if qroot.is_dir():
        for run_dir in qroot.iterdir():
            for rel in prune_files(run_dir):
                quarantined.setdefault(rel, []).append(run_dir / rel)
    where: Counter = Counter()
    problems = []
    for rel, facts in legacy.items():
        places = [p for p in [root / rel, *quarantined.get(rel, [])] if p.exists()]
        good = [p for p in places if (os.lstat(p).st_ino, sha256_file(str(p))) == facts]
        if not good:
            problems.append(f"lost_source: {rel}")
        elif len(places) > 1:
            problems.append(f"clobbered: {rel} has {len(places)} names (half-moved)")
        else:
            where["home" if good[0] == root / rel else "quarantine"] += 1
    return where, problems


def prune_trial(work: Path, ledger: Ledger, seed: int, blocks: int = 6) -> dict:
    """One trial: a migrated three-family root, one step (prune, restore or purge) killed
    at a random point, the tree checked, the step rerun to convergence, then restored
    (or, after purge, verified through the targets)."""
    rng = random.Random(seed)
    d = work / f"prune-{seed}"
    root = d / "root"
    build_root(root, PRUNE_SPECS, blocks, seed)
    facts = d / "facts.json"
    facts.write_text(json.dumps(facts_of(PRUNE_SPECS)))
    legacy = prune_files(root)
    ledger.cli("prune:migrate", "migrate", root, "--facts", facts, "--apply", "-q", allowed=bits_only(0))
    step = rng.choice(sorted(PRUNE_POINTS))
    point = rng.choice(PRUNE_POINTS[step])
    n = rng.randint(1, len(legacy)) if point in ("prune_move", "restore") else 1
    prune = ["prune", root, "--facts", facts, "--quiet-period", "0", "--apply", "-q"]
    purge = ["prune", root, "--purge", "--older-than", "0s", "--apply", "-q"]
    restore = ["restore", root / OWN / "journals" / "prune", "-q"]
    record = {"seed": seed, "step": step, "at": f"{point}:{n}", "killed": False, "ok": True}
    problems: list[str] = []

    def check(label: str, want: str | None = None) -> None:
        where, bad = prune_where(root, legacy)
        problems.extend(f"{label}: {b}" for b in bad)
        if want and where[want] != len(legacy):
            problems.append(f"{label}: not converged: {dict(where)} (want every legacy file {want})")

    if step != "prune":
        ledger.cli("prune:prune", *prune, allowed=bits_only(0))
    killed = ledger.cli(f"prune:{step}-killed", *({"prune": prune, "restore": restore, "purge": purge}[step]),
                        env={CRASH_ENV: f"{point}:{n}"})
    record["killed"] = killed.rc == -signal.SIGKILL
    ledger.counts["prune_kill_points"] += record["killed"]
    ledger.counts[f"prune_kill_points:{step}"] += record["killed"]
    check(f"after the kill in {step}")
    if step == "prune":
        ledger.cli("prune:rerun", *prune, allowed=bits_only(0))
        check("after the rerun", "quarantine")
        ledger.cli("prune:restore", *restore, allowed=bits_only(0))
        check("after restore", "home")
    elif step == "restore":
        ledger.cli("prune:rerun", *restore, allowed=bits_only(0))
        check("after the rerun", "home")
    else:
        ledger.cli("prune:rerun", *purge, allowed=bits_only(0))
        left = [p for p in (root / OWN / "quarantine").iterdir()]
        if left:
            problems.append(f"after the rerun of purge: quarantine folders left: {left}")
        said = ledger.cli("prune:restore-after-purge", *restore[:-1], allowed=bits_only(8))
        if "purged" not in said.stdout:
            problems.append("restore after purge does not say the files were purged")
        ledger.cli("prune:verify", "verify", root, allowed=bits_only(0))
    for p in problems:
        ledger.violate(p.split(": ", 2)[1] if p.count(": ") >= 2 else "prune", p)
    record["ok"] = not problems
    ledger.counts["prune_trials"] += 1
    shutil.rmtree(d, ignore_errors=True)
    return record
