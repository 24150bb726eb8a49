#!/usr/bin/env python3
"""Do two kvmigrates write the same manifest? Row for row, on every synth defect tree.

    .venv/bin/python scripts/manifest_equal.py OLD NEW [--verify none,size,hash] [--show 20]

    .venv/bin/python scripts/manifest_equal.py ce39941 .venv/bin/kvmigrate   # a commit against this checkout
    .venv/bin/python scripts/manifest_equal.py .venv/bin/kvmigrate .venv/bin/kvmigrate   # must say all equal

OLD and NEW are each a kvmigrate executable (a pip-installed console script: its
Python runs the scans) or a git revision of this repository (exported with
`git archive` into the work folder, its C leaf walk built in place, run by this
script's Python with PYTHONPATH pointing at the export).

The trees are built once, by this checkout's synth: every family and era of
tests/helpers/synth_matrix.py, clean and with each defect synth can inject into it (one per
tree), and the SGLang HiCache directories of SGL_ERAS the same way, plus one directory
holding all of them at once. Each tree is scanned with every --verify mode by both sides (one process per
side runs its scans through `kvmigrate.cli`, the two sides side by side), and the
manifests are compared sorted by relpath over the columns both have: columns only one
side has are listed and ignored (issue 17's typed findings add columns), as are the
metadata fields that differ by nature (tool_version, command) or that only one side
writes. The exit codes are compared too.

Prints a table (trees, manifests compared, equal, different per --verify mode), the
differences grouped by column with the most frequent old -> new values, and the first
differences. Exit 0 when every manifest is equal, 1 otherwise, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from kvmigrate.synth import SynthSpec, build  # noqa: E402

from helpers.synth_matrix import ERAS, cases, spec_of  # noqa: E402  (tests/helpers/synth_matrix.py)

VERIFY_MODES = ("none", "size", "hash")
IGNORED_META = ("tool_version", "command")  # differ by nature between two builds and two runs
# Runs the scans of one side in one process: `kvmigrate scan ...` through the CLI,
# one JSON job list in, one JSON list of exit codes out (no interpreter start per scan).
DRIVER = r"""
import contextlib, io, json, sys
import kvmigrate
from kvmigrate.cli import cli
jobs = json.load(open(sys.argv[1]))
codes = []
for argv in jobs:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            cli(args=argv, prog_name="kvmigrate")
            code = 0
        except SystemExit as exc:
            code = 0 if exc.code is None else exc.code
    codes.append(code if isinstance(code, int) else str(code))
json.dump({"codes": codes, "module": kvmigrate.__file__}, open(sys.argv[2], "w"))
"""


@dataclass
class Side:
    label: str
    python: str | None            # the interpreter that runs the batch driver
    env: dict[str, str] = field(default_factory=dict)
    exe: str | None = None        # a non-Python executable: one process per scan
    module: str = "?"             # the kvmigrate package the side imported


def side_of(spec: str, work: Path, name: str) -> Side:
    """A kvmigrate executable, or a git revision exported and built under WORK."""
    path = Path(spec)
    if path.is_file() and os.access(path, os.X_OK):
        with open(path, "rb") as f:
            first = f.readline().decode("utf-8", "replace")
        if first.startswith("#!") and "python" in first:
            return Side(spec, first[2:].strip().split()[0])
        return Side(spec, None, exe=str(path.resolve()))
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", spec + "^{commit}"],
                         capture_output=True, text=True)
    if rev.returncode:
        sys.exit(f"manifest_equal: {spec!r} is neither an executable file nor a git revision of {REPO}")
    src = work / f"{name}-{rev.stdout.strip()[:12]}"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev.stdout.strip()], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=src,
                           capture_output=True, text=True)
    if built.returncode:  # the extension is optional: that side scans with its Python walk
        print(f"manifest_equal: {spec}: C leaf walk not built, its scans use the Python walk", file=sys.stderr)
    return Side(spec, sys.executable, env={"PYTHONPATH": str(src)})


# SGLang HiCache directories (synth/sglang.py; not in tests/helpers/synth_matrix.py, whose
# migrate test needs a target for every era): every scheme, MLA and not, TP, PP, CP and
# pools, each with every defect synth can put in it; "sgl-all" is one directory holding
# every era at once (several deployments side by side, each with defects).
SGL_MODEL = "deepseek-ai/DeepSeek-V3"
SGL_ERAS = {
    "sgl-e1-tp2-full": ({"family": "sglang", "sgl_era": "e1", "tp": 2}, ["--kv-kind", "full", "--model-name", "m"]),
    "sgl-e2-tp2-mla": ({"family": "sglang", "sgl_era": "e2", "tp": 2, "kv_kind": "mla"},
                       ["--kv-kind", "mla", "--model-name", SGL_MODEL]),
    "sgl-e2-tp4-full": ({"family": "sglang", "sgl_era": "e2", "tp": 4}, ["--kv-kind", "full"]),
    "sgl-e3-tp2-mla": ({"family": "sglang", "sgl_era": "e3", "tp": 2, "kv_kind": "mla"},
                       ["--kv-kind", "mla", "--model-name", SGL_MODEL]),
    "sgl-e4-tp8-mla": ({"family": "sglang", "sgl_era": "e4", "tp": 8, "kv_kind": "mla", "model_name": SGL_MODEL},
                       ["--writer-layout", "page_first"]),
    "sgl-e4-tp2-pp2-full": ({"family": "sglang", "sgl_era": "e4", "tp": 2, "pp": 2, "pools": ("mamba",)}, []),
    "sgl-e4-tp2-cp2-full": ({"family": "sglang", "sgl_era": "e4", "tp": 2, "cp": 2},
                            ["--writer-layout", "layer_first"]),
}
SGL_ALL = "sgl-all"


def sgl_cases() -> list[tuple[str, str | None]]:
    """(era, defect) of the SGLang eras: clean, then each defect synth accepts for it."""
    from kvmigrate.synth import sglang
    from kvmigrate.synth.spec import check_spec

    out: list[tuple[str, str | None]] = [(era, None) for era in SGL_ERAS]
    for era, (spec, _) in SGL_ERAS.items():
        for defect in sglang.DEFECTS:
            try:
                check_spec(SynthSpec(**{**GEOMETRY_SGL, **spec, "defects": (defect,)}))
            except ValueError:
                continue
            out.append((era, defect))
    return out


GEOMETRY_SGL = {"layers": 2, "blocks": 6}


def build_trees(work: Path) -> list[tuple[str, str | None, Path]]:
    """(era, defect or None, root) for every era, clean and with each defect."""
    trees = []
    for era, defect in [(era, None) for era in ERAS] + cases():
        root = work / "trees" / era / (defect or "clean") / "root"
        root.mkdir(parents=True)
        build(root, SynthSpec(**spec_of(era, defect)))
        trees.append((era, defect, root))
    sgl = sgl_cases()
    for era, defect in sgl:
        root = work / "trees" / era / (defect or "clean") / "root"
        root.mkdir(parents=True)
        build(root, SynthSpec(**{**GEOMETRY_SGL, **SGL_ERAS[era][0], "defects": (defect,) if defect else ()}))
        trees.append((era, defect, root))
    root = work / "trees" / SGL_ALL / "clean" / "root"  # every era and defect in one directory
    root.mkdir(parents=True)
    seen: set[str] = set()
    for seed, (era, defect) in enumerate(sgl):
        if defect is not None and defect in seen:  # (one of each: some defects write a fixed name)
            continue
        seen.add(defect)
        build(root, SynthSpec(**{**GEOMETRY_SGL, **SGL_ERAS[era][0], "seed": seed,
                                 "defects": (defect,) if defect else ()}))
    trees.append((SGL_ALL, None, root))
    return trees


def facts_of(era: str) -> list[str]:
    if era == SGL_ALL:
        return ["--kv-kind", "mla", "--model-name", SGL_MODEL]
    return (SGL_ERAS.get(era) or ERAS[era])[1]


def scan_argv(root: Path, era: str, verify: str, out: Path) -> list[str]:
    return ["scan", str(root), *facts_of(era), "--verify", verify, "-o", str(out), "-q"]


def start(side: Side, jobs: list[list[str]], work: Path, name: str) -> subprocess.Popen | list[int]:
    """Start one side's scans (a batch process), or run them one process each."""
    if side.python is None:
        return [subprocess.run([side.exe, *argv], capture_output=True, cwd=work).returncode for argv in jobs]
    (work / f"{name}-jobs.json").write_text(json.dumps(jobs))
    # cwd WORK: `python -c` puts the working folder first on sys.path, never a checkout; the
    # child holds its own copy of the log's descriptor, so ours closes once it has started
    with open(work / f"{name}-driver.log", "w") as log:
        return subprocess.Popen([side.python, "-c", DRIVER, str(work / f"{name}-jobs.json"),
                                 str(work / f"{name}-codes.json")], cwd=work, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **side.env})


def finish(side: Side, started: subprocess.Popen | list[int], work: Path, name: str,
           tool: str = "manifest_equal") -> list[int]:
    """One side's exit codes, once its batch process (or its processes) ended; `tool` names
    the script in the message when the batch failed."""
    if isinstance(started, list):
        side.module = side.exe or "?"
        return started
    if started.wait():
        sys.exit(f"{tool}: the {name} side ({side.label}) failed, see {work / (name + '-driver.log')}")
    result = json.loads((work / f"{name}-codes.json").read_text())
    side.module = result["module"]
    return result["codes"]


def flat(meta: dict, prefix: str = "") -> dict[str, object]:
    """Metadata as paths: namespaces/<base>/status, facts/flags/kv_kind, ... ('/': base
    names hold dots, never slashes)."""
    out: dict[str, object] = {}
    for k, v in meta.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat(v, key + "/"))
        else:
            out[key] = v
    return out


def read(path: Path) -> tuple[dict[str, dict], dict[str, object], list[str]] | None:
    if not path.exists():
        return None
    table = pq.read_table(path)
    raw = (table.schema.metadata or {}).get(b"kvmigrate")
    meta = flat(json.loads(raw)) if raw else {}
    rows = {r["relpath"]: r for r in table.to_pylist()}
    return rows, meta, table.column_names


def shown(value: object) -> str:
    if isinstance(value, bytes):
        return value.hex()[:12] + ("…" if len(value) > 6 else "")
    text = repr(value)
    return text if len(text) <= 90 else text[:87] + "…"


def shown_pair(a: object, b: object) -> tuple[str, str]:
    """Two values as printed; two long strings with their common start and end elided,
    so the words that differ show."""
    if not (isinstance(a, str) and isinstance(b, str)) or max(len(a), len(b)) <= 90:
        return shown(a), shown(b)
    head = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    start, tail = max(head - 20, 0), max(tail - 20, 0)  # 20 characters of context either side
    cut = lambda t: ("…" if start else "") + t[start:len(t) - tail] + ("…" if tail else "")  # noqa: E731
    return shown(cut(a)), shown(cut(b))


def compare(a: Path, b: Path, code_a: int, code_b: int, only: dict[str, set]) -> list[tuple[str, str, object, object]]:
    """(relpath or '', column, old, new) for every difference of two manifests."""
    diffs: list[tuple[str, str, object, object]] = []
    if code_a != code_b:
        diffs.append(("", "(exit code)", code_a, code_b))
    ra, rb = read(a), read(b)
    if ra is None or rb is None:
        if (ra is None) != (rb is None):
            diffs.append(("", "(manifest written)", ra is not None, rb is not None))
        return diffs
    (rows_a, meta_a, cols_a), (rows_b, meta_b, cols_b) = ra, rb
    common = [c for c in cols_a if c in cols_b]
    only["old"].update(c for c in cols_a if c not in cols_b)
    only["new"].update(c for c in cols_b if c not in cols_a)
    for rel in sorted(set(rows_a) | set(rows_b)):
        if rel not in rows_b or rel not in rows_a:
            diffs.append((rel, "(row)", "present" if rel in rows_a else "absent",
                          "present" if rel in rows_b else "absent"))
            continue
        diffs += [(rel, c, rows_a[rel][c], rows_b[rel][c]) for c in common if rows_a[rel][c] != rows_b[rel][c]]
    only["meta old"].update(group_key("meta " + k)[5:] for k in meta_a if k not in meta_b)
    only["meta new"].update(group_key("meta " + k)[5:] for k in meta_b if k not in meta_a)
    for key in sorted(set(meta_a) & set(meta_b)):
        if key.split("/")[0] not in IGNORED_META and meta_a[key] != meta_b[key]:
            diffs.append(("", "meta " + key, meta_a[key], meta_b[key]))
    return diffs


def group_key(column: str) -> str:
    """meta namespaces/<base>/status -> meta namespaces/*/status (one line per field)."""
    parts = column.split("/")
    if column.startswith("meta namespaces/") and len(parts) > 2:
        parts[1] = "*"
    return "/".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("old", help="kvmigrate executable or git revision")
    ap.add_argument("new", help="kvmigrate executable or git revision")
    ap.add_argument("--verify", default=",".join(VERIFY_MODES), help="scan modes, comma-separated")
    ap.add_argument("--show", type=int, default=20, help="first differences to print")
    ap.add_argument("--work", help="work folder (default: a new temp folder, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args(argv)
    modes = [m for m in args.verify.split(",") if m]
    if not modes or any(m not in VERIFY_MODES for m in modes):
        ap.error(f"--verify takes {', '.join(VERIFY_MODES)}, got {args.verify!r}")
    work = Path(args.work or tempfile.mkdtemp(prefix="kvm-manifest-equal-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        return run(args, modes, work)
    finally:
        if not args.keep and not args.work:
            shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, modes: list[str], work: Path) -> int:
    t0 = time.monotonic()
    sides = {"old": side_of(args.old, work, "old"), "new": side_of(args.new, work, "new")}
    trees = build_trees(work)
    keys = [(era, defect, root, verify) for era, defect, root in trees for verify in modes]
    out = {name: work / "manifests" / name for name in sides}
    for d in out.values():
        d.mkdir(parents=True)
    name_of = {k: f"{k[0]}__{k[1] or 'clean'}__{k[3]}.parquet" for k in keys}
    jobs = {name: [scan_argv(root, era, verify, out[name] / name_of[(era, defect, root, verify)])
                   for era, defect, root, verify in keys] for name in sides}
    started = {name: start(side, jobs[name], work, name) for name, side in sides.items()}
    codes = {name: finish(side, started[name], work, name) for name, side in sides.items()}
    only: dict[str, set] = defaultdict(set)
    per_mode: dict[str, Counter] = defaultdict(Counter)
    by_column: dict[str, Counter] = defaultdict(Counter)
    manifests_of: dict[str, set] = defaultdict(set)
    first: list[str] = []
    for i, key in enumerate(keys):
        era, defect, _, verify = key
        diffs = compare(out["old"] / name_of[key], out["new"] / name_of[key], codes["old"][i], codes["new"][i], only)
        per_mode[verify]["equal" if not diffs else "different"] += 1
        tree = f"{era}/{defect or 'clean'} --verify {verify}"
        per_row: dict[str, list[str]] = defaultdict(list)
        for rel, column, a, b in diffs:
            g = group_key(column)
            old, new = shown_pair(a, b)
            by_column[g][(old, new)] += 1
            manifests_of[g].add(tree)
            per_row[rel].append(f"{column} {old} -> {new}")
        for rel, changes in per_row.items():
            if len(first) < args.show:
                first.append(f"  {tree}: {rel + ': ' if rel else ''}{'; '.join(changes)}")

    print(f"old: {args.old} (kvmigrate from {sides['old'].module})")
    print(f"new: {args.new} (kvmigrate from {sides['new'].module})")
    eras = len(ERAS) + len(SGL_ERAS) + 1
    print(f"{len(trees)} trees ({eras} eras clean, {len(SGL_ERAS)} of them SGLang plus one directory of every "
          f"SGLang era and defect; {len(trees) - eras} with one defect each), "
          f"{2 * len(keys)} scans in {time.monotonic() - t0:.0f} s\n")
    print(f"{'verify':<8}{'trees':>7}{'manifests compared':>20}{'equal':>8}{'different':>11}")
    for verify in modes:
        c = per_mode[verify]
        print(f"{verify:<8}{len(trees):>7}{c['equal'] + c['different']:>20}{c['equal']:>8}{c['different']:>11}")
    total = sum(per_mode.values(), Counter())
    print(f"{'all':<8}{len(trees):>7}{total['equal'] + total['different']:>20}{total['equal']:>8}"
          f"{total['different']:>11}")
    for what in ("old", "new", "meta old", "meta new"):
        if only[what]:
            print(f"\nignored, only in {what}: {', '.join(sorted(only[what]))}")
    if by_column:
        print("\ndifferences by column (rows or fields, manifests; most frequent old -> new):")
        for column, values in sorted(by_column.items(), key=lambda kv: -sum(kv[1].values())):
            top = "; ".join(f"{a} -> {b} ({n})" for (a, b), n in values.most_common(3))
            print(f"  {column}: {sum(values.values())} in {len(manifests_of[column])} manifests: {top}")
        print(f"\nfirst differences ({len(first)}):")
        print("\n".join(first))
    return 1 if total["different"] else 0


if __name__ == "__main__":
    sys.exit(main())
