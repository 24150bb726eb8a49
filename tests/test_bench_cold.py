"""scripts/bench.py's cold and scale arithmetic (issue 22) on given commands: a peer stopped
at its timeout is a lower bound, never a time; the scale figures leave the start-up out of
the marginal cost. No trees are built and nothing is timed against a limit."""

import argparse
from pathlib import Path

import kvbench as bench  # scripts/kvbench (pyproject.toml puts scripts/ on pytest's pythonpath)


def test_a_command_stopped_at_its_timeout_says_so(tmp_path):
    r = bench.run_measured(["sleep", "30"], timeout_s=0.3)
    assert r.timed_out and r.wall_s < 10
    done = bench.run_measured(["true"], timeout_s=30)
    assert not done.timed_out and done.rc == 0


def test_scale_figures_per_file_and_marginal_cost(tmp_path):
    b = bench.Bench.__new__(bench.Bench)
    b.groups, b.trees = [], {}
    times = {"files4k-0.1": 1.5, "files4k-0.3": 2.5, "files4k": 6.0}  # 0.5 s start-up + 10 us a file
    files = {"files4k-0.1": 100_000, "files4k-0.3": 300_000, "files4k": 1_000_000}
    cmds = []
    for name in bench.SCALE_TREES:
        b.trees[name] = {"counts": {"files": files[name]}}
        c = bench.Command(f"scale_{name}_scan", name, ["true"], "kvmigrate")
        c.runs.append(bench.Run(times[name], 0, 0, 100 * 1024, 0))
        cmds.append(c)
    b.groups.append(bench.Group("scale", "t", "files4k", cmds, []))
    f = b.scale_figures()["scan"]
    assert f["per_file_ratio"] == round(6.0 / 1_000_000 / (1.5 / 100_000), 3)
    assert f["marginal_us_per_file"] == [5.0, 5.0] and f["marginal_ratio"] == 1.0
    assert f["largest_rss_mib"] == 100.0


def test_rmlint_groups_from_its_json_summary(tmp_path):
    out = tmp_path / "r.json"
    out.write_text('[{"type": "duplicate_file"}, {"aborted": false, "duplicate_sets": 7}]')
    assert bench.count_rmlint_groups(str(out)) == 7
    assert bench.count_rmlint_groups(str(tmp_path / "missing.json")).startswith("not counted")


def test_each_command_goes_first_and_neighbours_run_both_ways_round():
    """A plain rotation (A,B,C then B,C,A) kept B always right after A: B could read what A
    left in a cache drop_caches cannot empty. Over two repetitions each pair that meets
    meets both ways round, and over 2n each command goes first."""
    cmds = ["A", "B", "C"]
    orders = [bench.rep_order(cmds, rep) for rep in range(6)]
    assert all(sorted(o) == cmds for o in orders)
    assert {o[0] for o in orders} == set(cmds)
    for rep in (0, 2, 4):
        after = {(x, y) for o in orders[rep:rep + 2] for x, y in zip(o, o[1:])}
        assert all((y, x) in after for x, y in after), (rep, orders[rep:rep + 2])
    assert bench.rep_order([], 3) == []


def test_scale_reports_cp_al_beside_migrate_but_not_as_a_target_of_ours(tmp_path):
    """The scale group's `cp -al` rows are the filesystem's own linking cost at each size:
    their figures are reported (scale_figures) and paired with migrate, never judged."""
    b = bench.Bench.__new__(bench.Bench)
    b.groups, b.trees, b.scale, b.startup = [], {}, "large", {}
    b.args = argparse.Namespace(startup_runs=5)
    files = {"files4k-0.1": 100_000, "files4k-0.3": 300_000, "files4k": 1_000_000}
    cmds = []
    for name in bench.SCALE_TREES:
        b.trees[name] = {"counts": {"files": files[name]}}
        for cmd, per_file in (("migrate", 100e-6), ("cpal", 80e-6)):
            c = bench.Command(f"scale_{name}_{cmd}", name, ["true"], "kvmigrate" if cmd == "migrate" else "baseline")
            c.runs.append(bench.Run(files[name] * per_file, 0, 0, 100 * 1024, 0))
            cmds.append(c)
    b.groups.append(bench.Group("scale", "t", "files4k", cmds, []))
    assert set(b.scale_figures()) == {"migrate", "cpal"}
    scale_targets = [t["target"] for t in b.targets() if t["target"].startswith("scale:")]
    assert scale_targets and all(" migrate " in t for t in scale_targets)


def test_a_small_command_is_not_charged_the_bench_s_own_peak_memory():
    """The kernel starts a child's peak RSS at its parent's high-water mark (vfork + exec), so
    after the bench once held 400 MiB every later `true` showed 400 MiB (rmlint's JSON did this
    to every cold row). The figure is the command's own."""
    big = bytearray(400 * 2**20)
    big[:: 4096] = b"x" * len(big[:: 4096])  # touch every page
    del big
    rss_now = bench.status_kib("VmRSS")  # a child starts at least at the parent's current RSS
    r = bench.run_measured(["true"])
    assert r.maxrss_kib < rss_now + 200 * 1024, (r.maxrss_kib, rss_now)


def test_rmlint_groups_are_counted_without_loading_its_whole_json(tmp_path):
    """rmlint's JSON for a 1M-file tree is hundreds of MiB; the count reads only its summary
    at the end, so the bench's own memory stays small."""
    out = tmp_path / "r.json"
    entry = '{"type": "duplicate_file", "path": "/' + "p" * 200 + '", "size": 4096},\n'
    with open(out, "w") as f:
        f.write("[\n")
        for _ in range(100_000):
            f.write(entry)
        f.write('{\n  "aborted": false,\n  "progress": 100,\n  "duplicate_sets": 42,\n  "duplicates": 9\n}\n]\n')
    bench.reset_peak_rss()
    before = bench.status_kib("VmHWM")
    assert bench.count_rmlint_groups(str(out)) == 42
    assert bench.status_kib("VmHWM") - before < 10 * 1024


def test_the_report_claims_only_what_it_measured():
    """The journal section once said 'other sessions were running tests' in every run, and
    a busy group blamed 'other processes' where the load was the cold group's own readers
    waiting on the disk: the report states the load averages it measured, not a cause."""
    import json

    result = json.loads((Path(__file__).resolve().parent.parent / "reports" / "benchmarks.json").read_text())
    text = bench.render(result)  # the journal section included
    assert "other sessions" not in text and "other processes" not in text
    assert f"load average {result['journal']['load_before']} before the group" in text
