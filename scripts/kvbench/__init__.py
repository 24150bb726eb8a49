"""kvbench: the benchmark behind scripts/bench.py (its docstring says what it measures).

    harness    timing commands (wall, rusage, bytes read), their order, the page cache
    trees      the synthetic trees: specs, sizes, space, counts, warmth
    groups     the comparison groups' commands and peers (a mixin of Bench)
    figures    ratios, replica checks, scale figures, targets (a mixin of Bench)
    core       Bench: a run's settings, kvmigrate, trees, groups
    installs   other revisions: a worktree (--journal-before), installs by commit (--before)
    journal, prune, baseline   the groups run after the others (or alone)
    memory     the memory group (alone): peak RSS of every lifecycle command at three sizes
    lmcache    the LMCache group (alone): reshard and a large fs tier's scan, LMCACHE.md
    mooncake   the Mooncake group (alone): a large store's scan and rekey, MOONCAKE.md
    runner     a full run, from the trees to the result
    rendering  BENCHMARKS.md and benchmarks.json
    compare    --before REV: two installs, figure by figure (BEFORE_AFTER.md)
    cli        the command line

Modules import only those above them in this list (rendering only harness), so there
is no import cycle; this package re-exports what the tests and callers use.
"""

from .cli import main, parse_args
from .core import Bench
from .groups import count_jdupes_groups, count_rdfind_groups, count_rmlint_groups
from .harness import Command, Group, Run, rep_order, reset_peak_rss, run_group, run_measured, status_kib
from .rendering import capped, render, write_json
from .runner import run
from .trees import SCALE_TREES, SCALES, TreeSpec, tree_specs, tree_summary

__all__ = [
    "SCALES", "SCALE_TREES", "Bench", "Command", "Group", "Run", "TreeSpec", "capped", "count_jdupes_groups",
    "count_rdfind_groups", "count_rmlint_groups", "main", "parse_args", "render", "rep_order", "reset_peak_rss",
    "run", "run_group", "run_measured", "status_kib", "tree_specs", "tree_summary", "write_json",
]
