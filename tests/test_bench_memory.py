"""scripts/bench.py --only memory at tiny sizes: every command of the lifecycle measured at each
size beside find and cp -al, the figures (growth per file, projection, marginal time per file)
on given numbers, the section merged into a full report, and the space check."""

import json
import sys
from pathlib import Path

import kvbench as bench  # scripts/kvbench (pyproject.toml puts scripts/ on pytest's pythonpath)
import pytest
from kvbench.memory import BASELINES, memory_figures
from kvbench.rendering import render_prune_only

from helpers.memory import LIFECYCLE

KVM = str(Path(sys.executable).with_name("kvmigrate"))
REPORTS = Path(__file__).resolve().parent.parent / "reports"


def sizes_of(peaks_kib: list[int], walls: list[float], files: list[int]) -> list[dict]:
    return [{"files": n, "steps": {"scan": {"maxrss_kib": k, "wall_s": w, "rc": 0}}}
            for n, k, w in zip(files, peaks_kib, walls)]


def test_growth_per_file_projection_and_marginal_cost_on_given_figures():
    files = [100_000, 1_000_000, 3_000_000]
    # 100 MiB + 90 B a file (the goal's growth); 0.5 s start-up + 10 us a file up to 1M, then 12 us a file
    kib = [round((100 * 2**20 + 90 * n) / 1024) for n in files]
    f = memory_figures(sizes_of(kib, [1.5, 10.5, 34.5], files), ["scan"])["scan"]
    assert abs(f["slope_bytes_per_file"] - 90) < 0.1
    assert abs(f["projected_mib_at_10m"] - (100 + 90 * 10_000_000 / 2**20)) < 0.1
    assert f["peak_goal_met"] is True
    assert f["marginal_us_per_file"] == [10.0, 12.0] and f["marginal_ratio"] == 1.2
    assert f["marginal_goal_met"] is False
    flat = memory_figures(sizes_of([100_000] * 3, [1.0, 2.0, 3.0], [10, 20, 30]), ["scan"])["scan"]
    assert flat["slope_bytes_per_file"] == 0 and flat["projected_mib_at_10m"] == round(100_000 / 1024, 1)
    assert memory_figures(sizes_of([1, 2], [1.0, 2.0], [10, 20]), ["audit"]) == {}  # not measured: no row


def test_the_memory_group_measures_every_lifecycle_command_at_each_size(tmp_path):
    work, out = tmp_path / "work", tmp_path / "reports"
    rc = bench.main(["--only", "memory", "--memory-files", "60,200", "--workdir", str(work), "--out-dir", str(out),
                     "--kvmigrate", KVM])
    assert rc == 0
    mem = json.loads((out / "benchmarks.json").read_text())["memory"]
    assert [s["files"] for s in mem["sizes"]] == [61, 201]  # the blocks of both ranks and config.json
    assert list(mem["figures"]) == [*BASELINES, *LIFECYCLE]
    for name, f in mem["figures"].items():
        assert all(rc in (0, 1) for rc in f["rc"]), (name, f["rc"])
        assert len(f["peak_rss_mib"]) == 2 and all(x > 0 for x in f["peak_rss_mib"])
        assert f["slope_bytes_per_file"] is not None and f["projected_mib_at_10m"] is not None
    text = (out / "BENCHMARKS.md").read_text()
    assert text.startswith("# kvmigrate benchmarks: the memory group")
    assert "## Memory: peak RSS of every command over a lifecycle, by tree size" in text
    for name in LIFECYCLE:
        assert f"\n| {name} | " in text
    assert "\n| cp_al (filesystem) | " in text and "\n| find (filesystem) | " in text
    assert not work.exists()  # the trees are removed (no --keep)


def test_memory_steps_run_the_chosen_commands_in_lifecycle_order(tmp_path, capsys):
    """--memory-steps (the 10M-file run's commands): those alone, in LIFECYCLE's order
    whatever order they are given in; an unknown name is refused before any tree is built."""
    work, out = tmp_path / "work", tmp_path / "reports"
    chosen = ["prune_apply", "scan", "migrate_apply", "scan_after", "prune_dry", "restore", "rollback"]
    rc = bench.main(["--only", "memory", "--memory-files", "60,200", "--memory-steps", ",".join(chosen),
                     "--workdir", str(work), "--out-dir", str(out), "--kvmigrate", KVM])
    assert rc == 0
    mem = json.loads((out / "benchmarks.json").read_text())["memory"]
    in_order = [name for name in LIFECYCLE if name in chosen]
    assert mem["commands"] == in_order and list(mem["figures"]) == [*BASELINES, *in_order]
    assert all(set(s["steps"]) == {*BASELINES, *in_order} for s in mem["sizes"])
    assert all(rc in (0, 1) for f in mem["figures"].values() for rc in f["rc"])
    assert "the commands chosen with --memory-steps" in (out / "BENCHMARKS.md").read_text()
    with pytest.raises(SystemExit, match="--memory-steps takes names of"):
        bench.main(["--only", "memory", "--memory-files", "60,200", "--memory-steps", "scan,nonsense",
                    "--workdir", str(tmp_path / "w2"), "--out-dir", str(tmp_path / "r2"), "--kvmigrate", KVM])
    assert not (tmp_path / "w2").exists()


def test_the_memory_section_merges_into_a_full_report_and_beside_the_prune_group():
    result = json.loads((REPORTS / "benchmarks.json").read_text())
    sizes = sizes_of([100_000, 110_000], [1.0, 2.0], [1000, 2000])
    result["memory"] = {"sizes": sizes, "figures": memory_figures(sizes, ["scan"]), "baselines": BASELINES,
                        "tree": "t", "command": "c", "when": "w", "load_before": 0.1, "load_after": 0.2}
    text = bench.render(result)
    assert "## Memory: peak RSS of every command over a lifecycle, by tree size" in text
    assert "\n| scan | 98 / 107 | 10,240 | " in text
    alone = {"machine": result["machine"], "memory": result["memory"]}
    if result.get("prune"):
        alone["prune"] = result["prune"]
    page = render_prune_only(alone)
    assert "## Memory: peak RSS" in page and page.startswith("# kvmigrate benchmarks: the ")


def test_the_space_check_prints_df_and_the_largest_tree_s_needs(tmp_path, capsys):
    rc = bench.main(["--only", "memory", "--check-space", "--memory-files", "1000,3000000", "--workdir",
                     str(tmp_path / "w"), "--kvmigrate", KVM, "--force"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "memory-3000000: 3,000,000 files" in out and "Inodes" in out  # df -i's header


def test_a_run_stopped_part_way_keeps_its_figures_so_far(tmp_path, monkeypatch):
    """A run stopped in its largest tree (Ctrl-C, a session's end) has written its report
    after each command: the commands run at every size have their slope, the others run
    at two sizes theirs (from those), and the page says the run stopped."""
    import kvbench.memory as M

    work, out = tmp_path / "work", tmp_path / "reports"
    real = M.measure_step

    def step(size, w, name, argv, log):
        if size["files"] > 150 and name == "prune_dry":
            raise KeyboardInterrupt
        real(size, w, name, argv, log)

    monkeypatch.setattr(M, "measure_step", step)
    chosen = "scan,migrate_apply,prune_dry,prune_apply"
    rc = bench.main(["--only", "memory", "--memory-files", "60,100,200", "--memory-steps", chosen,
                     "--workdir", str(work), "--out-dir", str(out), "--kvmigrate", KVM])
    assert rc == 32
    mem = json.loads((out / "benchmarks.json").read_text())["memory"]
    assert mem["stopped"] is True and [s["files"] for s in mem["sizes"]] == [61, 101, 201]
    f = mem["figures"]
    assert f["scan"]["peak_rss_mib"][2] is not None and f["prune_dry"]["peak_rss_mib"][2] is None
    assert f["prune_dry"]["slope_bytes_per_file"] is not None  # from 61 and 101 files
    text = (out / "BENCHMARKS.md").read_text()
    assert "The run stopped before its end" in text and "\n| prune_dry | " in text


def test_figures_of_a_command_missing_at_the_largest_size_come_from_the_sizes_it_ran_at():
    sizes = sizes_of([100_000, 110_000, 120_000], [1.0, 2.0, 3.0], [1000, 2000, 3000])
    del sizes[2]["steps"]["scan"]
    f = memory_figures(sizes, ["scan"])["scan"]
    assert f["peak_rss_mib"][2] is None and f["files"] == [1000, 2000, 3000]
    assert f["slope_bytes_per_file"] == 10_240 and f["marginal_us_per_file"] == [1000.0, 1000.0]
    assert "marginal_ratio" not in f  # one interval: nothing to compare its time per file with


def test_baselines_run_only_up_to_the_size_given(tmp_path):
    """--memory-baselines-up-to (the 10M-file run leaves out `cp -al` of its tree): `find` and
    `cp -al` run at the smaller size only, their figures come from it, and the page says so."""
    work, out = tmp_path / "work", tmp_path / "reports"
    rc = bench.main(["--only", "memory", "--memory-files", "60,200", "--memory-steps", "scan",
                     "--memory-baselines-up-to", "100", "--workdir", str(work), "--out-dir", str(out),
                     "--kvmigrate", KVM])
    assert rc == 0
    mem = json.loads((out / "benchmarks.json").read_text())["memory"]
    assert [set(s["steps"]) for s in mem["sizes"]] == [{*BASELINES, "scan"}, {"scan"}]
    assert mem["figures"]["cp_al"]["peak_rss_mib"][1] is None and mem["figures"]["scan"]["peak_rss_mib"][1]
    assert "at sizes up to 100 files only" in (out / "BENCHMARKS.md").read_text()


def test_a_command_run_at_one_size_only_is_not_counted_within_the_goal():
    """A run stopped in its largest tree, with two sizes: the commands not yet run there
    have no projection, and the page names them instead of counting them within 1 GiB."""
    sizes = sizes_of([100_000, 110_000], [1.0, 2.0], [100_000, 1_100_000])  # (10 B a file)
    sizes[0]["steps"]["verify"] = {"maxrss_kib": 90_000, "wall_s": 1.0, "rc": 0}
    mem = {"sizes": sizes, "figures": memory_figures(sizes, ["scan", "verify"]), "baselines": BASELINES,
           "tree": "t", "command": "c", "when": "w", "load_before": 0.1, "load_after": 0.2, "stopped": True}
    result = json.loads((REPORTS / "benchmarks.json").read_text())
    page = render_prune_only({"machine": result["machine"], "memory": mem})
    assert "1 of 1 commands within 1,024 MiB" in page
    assert "not projected, run at one size only: verify" in page


def test_a_named_run_is_kept_beside_the_group_s_run(tmp_path):
    """--memory-run-name: a run at other sizes (the 10M-file one) goes to `memory_NAME`
    and a section of its own; the group's run (`memory`) stays as it was, and both render."""
    work, out = tmp_path / "work", tmp_path / "reports"
    sizes = sizes_of([100_000, 110_000], [1.0, 2.0], [1000, 2000])
    group = {"sizes": sizes, "figures": memory_figures(sizes, ["scan"]), "baselines": BASELINES,
             "tree": "t", "command": "c", "when": "w", "load_before": 0.1, "load_after": 0.2}
    out.mkdir()
    machine = json.loads((REPORTS / "benchmarks.json").read_text())["machine"]
    (out / "benchmarks.json").write_text(json.dumps({"machine": machine, "memory": group}))
    rc = bench.main(["--only", "memory", "--memory-files", "60,200", "--memory-steps", "scan",
                     "--memory-run-name", "big", "--workdir", str(work), "--out-dir", str(out), "--kvmigrate", KVM])
    assert rc == 0
    result = json.loads((out / "benchmarks.json").read_text())
    assert result["memory"] == group
    assert result["memory_big"]["name"] == "big" and [s["files"] for s in result["memory_big"]["sizes"]] == [61, 201]
    text = (out / "BENCHMARKS.md").read_text()
    assert text.index("by tree size\n") < text.index("by tree size (the big run)\n")
    assert "\n| scan | 98 / 107 | 10,240 | " in text
