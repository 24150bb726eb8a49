#!/usr/bin/env python3
"""Side-by-side benchmarks of kvmigrate against the standard tools, on the same trees.

Builds synthetic cache trees with `kvmigrate synth` (several processes in parallel),
warms them, then runs each comparison group on the same warm tree, changing the order
of the commands every repetition (A,B,C; C,B,A; B,C,A; A,C,B ...), and writes `reports/BENCHMARKS.md`
and `reports/benchmarks.json` with medians, ratios, peak RSS and the issue's targets.

    python3 scripts/bench.py --scale small --reps 2        # ~1-2 minutes
    python3 scripts/bench.py --scale large --keep          # the issue's sizes (1M files, 4 GiB)
    python3 scripts/bench.py --scale small --profile       # + "Where the time goes"
    python3 scripts/bench.py --scale large --profile-only  # profile a kept tree, add to the report
    python3 scripts/bench.py --before b0bf138              # before/after in one run (kvbench/compare.py)
    python3 scripts/bench.py --before b0bf138 --scale small   # the same, a quick try (~2-3 min)
    python3 scripts/bench.py --only prune --prune-files 20000  # prune vs rm -rf, restore (issue 19)
    python3 scripts/bench.py --only memory --scale small       # peak RSS of every lifecycle command at 3 sizes
    python3 scripts/bench.py --only lmcache                    # LMCache reshard and 1M-chunk scan (LMCACHE.md)
    python3 scripts/bench.py --only mooncake                   # Mooncake 1M-object scan and rekey (MOONCAKE.md)

`--before REV` (alias `--compare`) installs REV and `--after` (default HEAD) into their own
venvs and times each kvmigrate figure below with both, alternating old/new every repetition
on the same warm trees; it writes reports/redesign/BEFORE_AFTER.md and before_after.json
(old median, new median, new/old, PASS when <= 1.05) and exits 1 when a figure fails.
Its groups add `report` (report of a manifest, audit ROOT); the peers are not run.

Groups (kvbench/groups.py; journal, prune, baseline and lmcache in modules of their own):
  meta      kvmigrate scan --verify size  vs  find -printf, fdfind           (4 KiB tree)
  hash4k    kvmigrate scan --verify hash  vs  find|xargs xxhsum -H2, jdupes -r, rdfind
  hash1m    the same on the 1 MiB-file tree (bandwidth rather than per-file overhead)
  migrate   kvmigrate migrate ROOT --apply (default flags, its own scan) and --manifest M(size)
            --apply (apply reads what it places)  vs  the same safety by hand: xxhsum -H2 of the
            legacy folders, then cp -al; plain cp -al and a `scan --verify hash` manifest's apply
            beside                                                          (4 KiB tree)
  flat      an SGLang HiCache directory (one flat folder of page files, MLA, 1 KiB pages; 50,000 at
            small, 1,000,000 at large, or --flat-files N): scan --verify size vs find -printf,
            scan --verify hash vs find|xargs xxhsum -H2 (serial) and xargs -P8 -n512 (parallel)
  startup   kvmigrate --help (20 runs) and python3 -c pass for reference
  cold4k    (issue 22) the page cache dropped before every command, 4 KiB tree: scan --verify size vs
            find -printf; scan --verify hash vs find|xargs -P(4 x cores) -n512 xxhsum -H2 and rmlint
            -T df (one run, stopped at --rmlint-timeout: a lower bound)
  cold1m    the same on the 1 MiB tree, plus fio's O_DIRECT sequential read of the same files with
            kvmigrate's reads in flight (the device's limit)
  scale     scan --verify size, report and migrate --manifest M --apply at a tenth, three tenths and
            all of the 4 KiB tree (100k, 300k, 1M files at large): per-file and marginal cost, peak RSS
  journal   (alone: `--only journal [--before REV]`) journal bytes per linked block and
            `rollback` time at 100,000 blocks, this checkout against REV (a git worktree of
            it with its own venv); merged into an existing benchmarks.json
  prune     (alone: `--only prune [--prune-files N]`) `kvmigrate prune --apply` of N migrated
            legacy block files (default 500,000) vs `rm -rf` of the same legacy folders (one run,
            the ratio) and `kvmigrate restore` of that prune; merged into an existing
            benchmarks.json, or a prune-only report in a fresh --out-dir
  memory    (alone: `--only memory [--memory-files N,N,N] [--memory-steps A,B] [--check-space]
            [--memory-baselines-up-to N] [--memory-run-name NAME]`) every command of a
            migration's lifecycle (tests/helpers/memory.py) on llm-d TP=2 MLA trees of three sizes
            (20k/60k/120k files at small, 100k/1M/3M at large; each built, measured, removed in turn),
            beside `cp -al` and `find` of the tree: peak RSS at each size, its growth per file between
            the two largest, its projection at 10M files (goal <= 1 GiB), the marginal time per file
            (goal: largest/smallest <= 1.1x); df and df -i checked first; merged into the --out-dir's
            benchmarks.json like prune (`memory`; a run given a NAME as `memory_NAME` beside it, e.g.
            the 10M-file run)
  baseline  (alone: `--only baseline [--baseline-files N] [--baseline-cold]`) `audit --verify
            hash --baseline auto` of an unchanged tree of N files of 4 KiB (default 1,000,000)
            vs `find -printf` and the full hash audit, with the default --recheck and 0;
            bytes read (rchar, read_bytes) as a share of the tree's; warm unless
            --baseline-cold; merged into the --out-dir's benchmarks.json if it has a full
            report, else a report of its own there
  lmcache   (alone: `--only lmcache [--lmcache-chunks N] [--lmcache-scan-chunks N] [--lmcache-warm-only]`)
            an LMCache fs tier of N Llama-3.1-8B chunks (256 tokens, TP 2: 16 MiB + 28 a file) resharded
            to TP 4 (scripts/bench_lmcache.py: transforms_lmcache.write_reshard, or `migrate` once it
            plans reshard) vs cat of the files + cp -R of them; `scan` of a synth fs tier of N chunk files
            (default 1,000,000) vs find -printf and the Python floor; warm, then cold (drop_caches, root);
            writes reports/LMCACHE.md and lmcache.json, deletes its trees
  mooncake  (alone: `--only mooncake [--mooncake-objects N] [--mooncake-reps N] [--mooncake-warm-only]`)
            a Mooncake Store bucket client root of N objects (default 1,000,000) in N/500 pairs, raw vLLM
            keys and 64-byte values, written by scripts/bench_mooncake.py through kvmigrate/formats/mooncake.py:
            `scan` vs find -printf; the rekey (`migrate --manifest M --apply --engine-stopped`, rolled back
            after each run, untimed) vs cp of the .meta files, when this kvmigrate applies rekey (a probe
            says; else a marked slot); warm, then cold (drop_caches, root); writes reports/MOONCAKE.md and
            mooncake.json, deletes its trees
baseline, journal and prune also run after the other groups of a full run (`--only
meta,...,baseline,journal,prune`): one run, one report (baseline then on the run's 4 KiB tree).
The scan groups also time the Python floor (scripts/floor_walk.py) as a reference.

Needs only the Python standard library plus the Debian packages xxhash, jdupes, rdfind,
fd-find, findutils, coreutils, util-linux (fincore), and rmlint and fio for the cold groups; a run checks only the tools of
its groups (`--only migrate` needs xxhash, findutils, coreutils, util-linux). `--profile` uses py-spy when it is
installed next to kvmigrate's interpreter or on PATH (`pip install py-spy`: it samples the
worker processes too), else cProfile. `.ci/run` does not run it.
Peak RSS and CPU times come from os.wait4() on each command (the rusage of the process
and its reaped children, the same figure `/usr/bin/time -v` prints as "Maximum resident
set size"); the bench resets its own peak RSS before each command, because a child starts
with its parent's high-water mark.

The code is the package scripts/kvbench/ (its docstring lists the modules); this file is
its command line.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: kvbench, profile_spy beside it

from kvbench.cli import main

if __name__ == "__main__":
    sys.exit(main())
