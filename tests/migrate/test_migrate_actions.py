"""Typed plan actions (issue 17): every action kind the planner produces has one entry
in `actions.ACTIONS` that executes it, renders its `--print-commands` line and its
dry-run line; the shell lines do what `--apply` does."""

from __future__ import annotations

import json
import subprocess

import pytest
from test_transforms_e2e import FACTS, MIXED

from kvmigrate.migrate.actions import ACTIONS, ActionKind
from kvmigrate.migrate.model import CREATING
from kvmigrate.migrate.plan import build_plan

from helpers.cli_helpers import run
from helpers.reference_reader import content_listing

MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]
LINK = ({"family": "vllm", "scheme": "S2", "tp": 2}, ["--model-dtype", "bfloat16", "--kv-kind", "full", "--target", "vllm-0.24"])


def _plan(tmp_path, root, flags):
    m = tmp_path / f"{root.name}.parquet"
    code, out = run("migrate", root, *flags, "--manifest-out", m)
    assert code == 1, out  # changes pending
    return build_plan(m)


def test_every_action_the_planner_produces_has_a_kind_that_executes_and_renders_it(tmp_path, synth_root):
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps(FACTS))
    trees = [((LINK[0],), LINK[1]),
             (({"family": "llmd", "tp": 2, "kv_kind": "mla"}, {"family": "vllmcpp", "tp": 2, "kv_kind": "mla"}), MLA),
             (MIXED, ["--facts", facts]),
             (({"family": "lmcache", "lmc_backend": "gds", "tp": 2, "layers": 2, "block_tokens": 4},),
              ["--writer-release", "0.5.6", "--pythonhashseed", "0", "--target-tp", "4", "--total-kv-heads", "8",
               "--head-dim", "4", "--layers", "2"])]
    produced = {}
    for i, (specs, flags) in enumerate(trees):
        root, _ = synth_root(*specs, root_name=f"r{i}")
        plan = _plan(tmp_path, root, flags)
        for tp in plan.targets:
            for act in tp.actions:
                produced.setdefault(act.action, (act, tp))
    assert set(produced) == set(CREATING)  # these trees exercise every creating action
    assert set(ACTIONS) == set(CREATING)
    for name, (act, tp) in produced.items():
        kind = ACTIONS[name]
        assert kind.name == name
        for hook in ("execute", "shell"):
            assert getattr(type(kind), hook) is not getattr(ActionKind, hook), f"{name} has no {hook}"
        dst = f"/dest/{act.target_relpath}"
        for mode in ("link", "copy"):
            line = kind.shell(act, tp, "/src", dst, mode)
            assert line.startswith(f"[ -e {dst} ] || ") and "\n" not in line
        assert kind.text(6, 24 * 1024) == f"  {kind.label:<40}         6 blocks    24.0 KiB"
        assert kind.output_size(act) > 0


@pytest.mark.parametrize("mode", ["link", "copy"])
def test_the_shell_lines_of_link_actions_make_the_tree_apply_makes(tmp_path, synth_root, mode):
    """(The other kinds' scripts are checked against --apply in test_migrate_safety and
    test_transforms_e2e: `test_print_commands_script_*`.)"""
    spec, flags = LINK
    applied, _ = synth_root(spec, root_name="a")
    scripted, _ = synth_root(spec, root_name="b")
    code, out = run("migrate", applied, *flags, "--mode", mode, "--apply")
    assert code == 0, out
    code, script = run("migrate", scripted, *flags, "--mode", mode, "--print-commands")
    assert code == 0 and (" ln -- " in script) == (mode == "link")
    proc = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert content_listing(applied) == content_listing(scripted)
