#!/usr/bin/env python3
"""Do two kvmigrates print and journal the same things? Every output of a lifecycle, byte for byte.

    .venv/bin/python scripts/outputs_equal.py OLD NEW [--trees all|matrix|N] [--show 20]

    .venv/bin/python scripts/outputs_equal.py /work/base/.venv/bin/kvmigrate .venv/bin/kvmigrate
    .venv/bin/python scripts/outputs_equal.py .venv/bin/kvmigrate .venv/bin/kvmigrate   # must say all equal

The sibling of scripts/manifest_equal.py, which compares the manifests of scans: this one
compares what every other command prints and writes. OLD and NEW are taken the same way (a
kvmigrate executable, or a git revision exported and built), and the trees are the same
synth corpus (tests/helpers/synth_matrix.py's eras clean and with each defect, the SGLang
HiCache eras, the directory of every SGLang era), built once by this checkout's synth and
copied (`cp -a`) for each side, so each side works on its own copy of the same bytes.

On each tree both sides run the same lifecycle (LIFECYCLE below): scan, report (text, JSON),
migrate dry run (text, --json, --print-commands), migrate --apply --json, verify --journal,
a second scan, prune dry run (text, --json: the prune plan), prune --apply --json, restore,
rollback --dry-run, rollback --dry-run --list, rollback. Compared, each as one output:

- every command's exit code and stdout;
- every journal file at the end (the migration's, written beside ROOT with --journal: under
  ROOT the second scan would count its compressed size, which differs by nature; the prune's
  under ROOT/.kvmigrate/journals): its decoded records, frame by frame, as the JSON lines
  the writer compressed;
- the tree at the end: every path with its type and size, and the bytes of each file outside
  ROOT/.kvmigrate (journals are compared above).

Only what differs by nature is normalised before the byte comparison: run ids (also in
journal and quarantine names), timestamps, the absolute work folder of each side's copy,
durations and rates, ages ("written 20 s ago": in a text holding one, runs of column padding
count as one space, since the age's width sets a table's columns), process ids of temp-file
names, tool_version, and in journals the inode, device and mtime of files (each copy has its
own) and a linked record's frame offset (it depends on the compressed size of earlier frames;
it is compared as the frame's index).

Prints a table (trees, outputs compared, equal, different per output kind) and the first
differences as unified diffs. Exit 0 when every output is equal, 1 otherwise, 2 on a usage
error.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from pathlib import Path

from manifest_equal import (  # scripts/manifest_equal.py: the same sides and the same corpus
    GEOMETRY_SGL,
    SGL_ERAS,
    Side,
    build_trees,
    facts_of,
    finish,
    side_of,
)

from kvmigrate.synth import SynthSpec, build

from helpers.synth_matrix import ERAS, spec_of  # tests/helpers/synth_matrix.py (manifest_equal puts tests/ on the path)

JOURNALS = Path(".kvmigrate") / "journals"  # under ROOT: the prune journals
MIGRATION_JOURNALS = "journals"  # beside ROOT: the migration's (lifecycle)
# Runs one side's jobs in one process through `kvmigrate.cli` (no interpreter start per
# command): a JSON job list in (argv, stdout file), a JSON list of exit codes out.
DRIVER = r"""
import contextlib, io, json, sys
import kvmigrate
from kvmigrate.cli import cli
jobs_file, codes_file = sys.argv[1:3]
jobs = json.load(open(jobs_file))
codes = []
for job in jobs:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["kvmigrate", *job["argv"]]  # the command line the outputs and journals record
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli(args=job["argv"], prog_name="kvmigrate")
            code = 0
        except SystemExit as exc:
            code = 0 if exc.code is None else exc.code
    with open(job["out"], "w") as f:
        f.write(out.getvalue())
    codes.append(code if isinstance(code, int) else str(code))
json.dump({"codes": codes, "module": kvmigrate.__file__}, open(codes_file, "w"))
"""


def lifecycle(root: Path, era: str, side_dir: Path) -> list[tuple[str, list[str]]]:
    """(step, argv) of one tree's lifecycle, in the order both sides run it. The migration's
    journal goes beside the tree (SIDE_DIR/journals): under ROOT the second scan would count
    its compressed size, which differs by nature (inode numbers in its records)."""
    facts = facts_of(era)
    m1, m2 = side_dir / "m1.parquet", side_dir / "m2.parquet"
    journals = str(side_dir / MIGRATION_JOURNALS)
    prune = ["prune", str(root), "--manifest", str(m2), "--quiet-period", "0s", "--migration-journal", journals]
    steps: list[tuple[str, list[str]]] = [
        ("scan", ["scan", str(root), *facts, "--verify", "size", "-o", str(m1)]),
        ("report", ["report", str(m1)]),
        ("report_json", ["report", str(m1), "--format", "json"]),
        ("migrate_dry", ["migrate", "--manifest", str(m1)]),
        ("migrate_dry_json", ["migrate", "--manifest", str(m1), "--json"]),
        ("migrate_commands", ["migrate", "--manifest", str(m1), "--print-commands"]),
        ("migrate_apply_json", ["migrate", "--manifest", str(m1), "--apply", "--json", "--journal", journals]),
        ("verify", ["verify", str(root), "--journal", journals]),
        ("scan_after", ["scan", str(root), *facts, "--verify", "size", "-o", str(m2)]),
        ("prune_dry", prune),
        ("prune_dry_json", [*prune, "--json"]),
        ("prune_apply_json", [*prune, "--apply", "--json"]),
        ("restore", ["restore", str(root / JOURNALS / "prune")]),
        ("rollback_dry", ["rollback", journals, "--dry-run"]),
        ("rollback_list", ["rollback", journals, "--dry-run", "--list"]),
        ("rollback", ["rollback", journals]),
    ]
    return steps


LIFECYCLE = tuple(name for name, _ in lifecycle(Path("r"), "llmd-tp2-mla", Path("w")))

# --- normalising: only what differs by nature between two runs on two copies -------------
RUN_ID = re.compile(r"\d{8}T\d{6}Z-\d+-[0-9a-f]{6}")
TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?")
TMP_PID = re.compile(r"(\.kvmigrate-)\d+(\.tmp)")
DURATION = re.compile(r"\b(in|took|after|elapsed) \d+(\.\d+)? ?(s|ms|µs|us|min|h)\b")
PADDING = re.compile(r"(?<=\S) {2,}(?=\S)")
AGE = re.compile(r"\b\d+(\.\d+)? ?(s|min|h|d|days?) ago\b")  # a namespace's age at the moment of the run
RATE = re.compile(r"\b\d+(\.\d+)? ?([KMGT]i?B|files|blocks|B)/s\b")
JSON_BY_NATURE = re.compile(
    r'"(tool_version|run_id|pid|t?ino|t?dev|t?mtime_ns|started|finished|started_at|finished_at|time|ts|'
    r'[a-z_]*duration[a-z_]*|[a-z_]*elapsed[a-z_]*|wall_s|[a-z_]*_ago)": ?'
    r'(-?\d+(\.\d+)?(e-?\d+)?|"[^"]*"|\[[^\]]*\]|null)')


def normalise(text: str, work: str) -> str:
    """TEXT with the values that differ by nature replaced by placeholders."""
    text = text.replace(work, "<W>")
    text = JSON_BY_NATURE.sub(lambda m: f'"{m.group(1)}":<{m.group(1)}>', text)
    text = RUN_ID.sub("<run>", text)
    text = TIMESTAMP.sub("<time>", text)
    text = TMP_PID.sub(r"\1<pid>\2", text)
    text = DURATION.sub(r"\1 <duration>", text)
    if AGE.search(text):  # its width pads the columns of a table it is in: padding compared as one space
        text = PADDING.sub(" ", AGE.sub("<age> ago", text))
    return RATE.sub("<rate>", text)


# --- journals: frames decoded without either side's code ----------------------------------
FRAME = struct.Struct("<4sII")  # magic, payload length, crc32 (kvmigrate/migrate/journal.py)
LINKED_AT = re.compile(r'("at": ?)(\d+)')


def journal_text(path: Path) -> str:
    """A journal as text: each frame's JSON lines (a `linked` record's `at`, the byte
    offset of its intent frame, as that frame's index); JSON-lines journals as they are."""
    data = path.read_bytes()
    if not data.startswith(b"KVJF"):
        return data.decode("utf-8", "replace")
    frames: list[str] = []
    index_of: dict[int, int] = {}
    pos = 0
    while pos + FRAME.size <= len(data):
        magic, length, crc = FRAME.unpack_from(data, pos)
        payload = data[pos + FRAME.size:pos + FRAME.size + length]
        if magic != b"KVJF" or len(payload) < length or zlib.crc32(payload) != crc:
            frames.append(f"(torn frame at {pos}: {len(data) - pos} bytes)")
            break
        index_of[pos] = len(frames)
        frames.append(zlib.decompress(payload).decode("utf-8", "replace"))
        pos += FRAME.size + length
    at = lambda m: f"{m.group(1)}frame#{index_of.get(int(m.group(2)), m.group(2))}"  # noqa: E731
    return "".join(f"--- frame {i}\n{LINKED_AT.sub(at, text)}" + ("" if text.endswith("\n") else "\n")
                   for i, text in enumerate(frames))


def journal_outputs(tree_dir: Path, work: str) -> dict[str, str]:
    """Normalised name -> normalised text of every journal file of one tree's lifecycle (the
    migration's beside ROOT, the prune's under it), and their listing."""
    out: dict[str, str] = {}
    files = []
    for base in (tree_dir / MIGRATION_JOURNALS, tree_dir / "root" / JOURNALS):
        files += sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
    names = [normalise(str(p.relative_to(tree_dir)), work) for p in files]
    out["journals (files)"] = "\n".join(names) + "\n"
    for name, path in zip(names, files):
        key = f"journal {name}"
        while key in out:  # two runs' journals of the same kind: same name once normalised
            key += "'"
        out[key] = normalise(journal_text(path), work)
    return out


def tree_listing(root: Path, work: str) -> str:
    """Every path under ROOT at the end: its type; a file's size and bytes' digest (journals:
    their records are compared, not their compressed size); a symlink's target."""
    lines = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = Path(dirpath).relative_to(root)
        for d in dirnames:
            lines.append(f"d {normalise(str(rel_dir / d), work)}")
        for f in sorted(filenames):
            p = Path(dirpath) / f
            rel = rel_dir / f
            name = normalise(str(rel), work)
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                lines.append(f"l {name} -> {normalise(os.readlink(p), work)}")
            elif not stat.S_ISREG(st.st_mode):  # a FIFO, socket or device a defect left: never opened
                lines.append(f"? {name} mode {stat.S_IFMT(st.st_mode):o}")
            elif rel.parts[:1] == (".kvmigrate",):
                lines.append(f"f {name}")
            else:
                lines.append(f"f {name} {st.st_size} {hashlib.sha256(p.read_bytes()).hexdigest()[:16]}")
    return "\n".join(lines) + "\n"


# --- running one side ---------------------------------------------------------------------
def start(side: Side, jobs: list[dict], work: Path, name: str) -> subprocess.Popen | list[int]:
    """Start one side's jobs (a batch process), or run them one process each."""
    if side.python is None:
        codes = []
        for job in jobs:
            with open(job["out"], "w") as out:
                codes.append(subprocess.run([side.exe, *job["argv"]], stdout=out, stderr=subprocess.DEVNULL,
                                            cwd=work / name).returncode)
        return codes
    (work / f"{name}-jobs.json").write_text(json.dumps(jobs))
    # cwd WORK/NAME: the same relative paths on both sides, and never a checkout first on sys.path
    with open(work / f"{name}-driver.log", "w") as log:
        return subprocess.Popen([side.python, "-c", DRIVER, str(work / f"{name}-jobs.json"),
                                 str(work / f"{name}-codes.json")], cwd=work / name, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **side.env})


def first_diff(a: str, b: str, context: int = 2, lines: int = 12) -> str:
    """The start of a unified diff of A and B; long lines cut around where they differ."""
    diff = list(difflib.unified_diff(a.splitlines(), b.splitlines(), "old", "new", n=context, lineterm=""))[2:]
    at = 0  # column of the first difference of the last -/+ pair
    for i, line in enumerate(diff):
        if line.startswith("-") and i + 1 < len(diff) and diff[i + 1].startswith("+"):
            other = diff[i + 1]
            at = next((k for k, (x, y) in enumerate(zip(line[1:], other[1:])) if x != y), 0)
        elif not line.startswith("+"):
            at = 0
        if len(line) > 200:
            start = max(0, at - 80)
            diff[i] = line[:1] + ("…" if start else "") + line[1 + start:1 + start + 190] + "…"
    return "\n".join("      " + line for line in diff[:lines]) + ("\n      …" if len(diff) > lines else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("old", help="kvmigrate executable or git revision")
    ap.add_argument("new", help="kvmigrate executable or git revision")
    ap.add_argument("--trees", default="all",
                    help="all (the whole corpus: 254 trees), or a comma-separated list of ERA or ERA/DEFECT "
                         "trees to build alone (e.g. llmd-tp2-mla,vllm-S1-tp1-full/torn_tail)")
    ap.add_argument("--show", type=int, default=10, help="first differences to print")
    ap.add_argument("--work", help="work folder (default: a new temp folder, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="kvm-outputs-equal-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        return run(args, work)
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)


def selected(work: Path, spec: str) -> list[tuple[str, str | None, Path]]:
    """The trees to compare: the whole corpus, or the named ERA[/DEFECT] trees built alone."""
    if spec == "all":
        return build_trees(work)
    trees = []
    for name in (w.strip() for w in spec.split(",") if w.strip()):
        era, _, defect = name.partition("/")
        defect = None if defect in ("", "clean") else defect
        if era in SGL_ERAS:
            kwargs = {**GEOMETRY_SGL, **SGL_ERAS[era][0], "defects": (defect,) if defect else ()}
        elif era in ERAS:
            kwargs = spec_of(era, defect)
        else:
            sys.exit(f"outputs_equal: --trees: {era!r} is not an era of the corpus "
                     f"({', '.join([*ERAS, *SGL_ERAS])})")
        root = work / "trees" / era / (defect or "clean") / "root"
        root.mkdir(parents=True)
        build(root, SynthSpec(**kwargs))
        trees.append((era, defect, root))
    return trees


def run(args: argparse.Namespace, work: Path) -> int:
    t0 = time.monotonic()
    sides = {"old": side_of(args.old, work, "old"), "new": side_of(args.new, work, "new")}
    trees = selected(work / "built", args.trees)
    jobs: dict[str, list[dict]] = {name: [] for name in sides}
    plan: list[tuple[str, str, Path]] = []  # (tree label, step, relative stdout file) in job order
    roots: dict[str, dict[str, Path]] = {name: {} for name in sides}
    for i, (era, defect, built) in enumerate(trees):
        label = f"{era}/{defect or 'clean'}"
        for name in sides:
            tree_dir = work / name / f"{i:03d}"
            tree_dir.mkdir(parents=True)
            subprocess.run(["cp", "-a", str(built), str(tree_dir / "root")], check=True)
            roots[name][label] = tree_dir
            for step, argv in lifecycle(tree_dir / "root", era, tree_dir):
                jobs[name].append({"argv": argv, "out": str(tree_dir / f"{step}.out")})
        plan += [(label, step, Path(f"{i:03d}") / f"{step}.out") for step, _ in lifecycle(Path(), era, Path())]
    started = {name: start(side, jobs[name], work, name) for name, side in sides.items()}
    codes = {name: finish(side, started[name], work, name, "outputs_equal") for name, side in sides.items()}

    per_kind: dict[str, Counter] = {}
    first: list[str] = []
    different_trees: set[str] = set()

    def judge(kind: str, label: str, what: str, a: str, b: str) -> None:
        equal = a == b
        per_kind.setdefault(kind, Counter())["equal" if equal else "different"] += 1
        if not equal:
            different_trees.add(label)
            if len(first) < args.show:
                first.append(f"  {label}: {what}\n{first_diff(a, b)}")

    for k, (label, step, rel) in enumerate(plan):
        texts = {name: f"exit code {codes[name][k]}\n" + normalise((work / name / rel).read_text(),
                                                                    str(work / name / rel.parent))
                 for name in sides}
        judge("stdout" if not step.endswith("_json") else "stdout (json)", label, step, texts["old"], texts["new"])
    for label in dict.fromkeys(label for label, _, _ in plan):
        outs = {name: journal_outputs(roots[name][label], str(roots[name][label])) for name in sides}
        for key in sorted(set(outs["old"]) | set(outs["new"])):
            judge("journals", label, key, outs["old"].get(key, "(absent)\n"), outs["new"].get(key, "(absent)\n"))
        trees_at_end = {name: tree_listing(roots[name][label] / "root", str(roots[name][label])) for name in sides}
        judge("tree at the end", label, "tree at the end", trees_at_end["old"], trees_at_end["new"])

    print(f"old: {args.old} (kvmigrate from {sides['old'].module})")
    print(f"new: {args.new} (kvmigrate from {sides['new'].module})")
    print(f"{len(trees)} trees ({'the whole corpus of scripts/manifest_equal.py' if args.trees == 'all' else args.trees})"
          f", {len(LIFECYCLE)} commands each by both sides in {time.monotonic() - t0:.0f} s; "
          f"{len(different_trees)} trees with a difference\n")
    print(f"{'output':<18}{'trees':>7}{'outputs compared':>18}{'equal':>8}{'different':>11}")
    total: Counter = Counter()
    for kind, c in per_kind.items():
        total += c
        print(f"{kind:<18}{len(trees):>7}{c['equal'] + c['different']:>18}{c['equal']:>8}{c['different']:>11}")
    print(f"{'all':<18}{len(trees):>7}{total['equal'] + total['different']:>18}{total['equal']:>8}"
          f"{total['different']:>11}")
    if first:
        print(f"\nfirst differences ({len(first)}):")
        print("\n".join(first))
    else:
        print("\nall equal")
    return 1 if total["different"] else 0


if __name__ == "__main__":
    sys.exit(main())
