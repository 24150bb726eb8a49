"""`kvmigrate demo`: the README's main-job command runs the whole flow and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_runs_every_step_and_leaves_sources_untouched(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvmigrate", "demo", str(tmp_path / "d")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for step in ("scan", "report", "migrate --manifest", "--apply", "verify", "rollback"):
        assert f"$ kvmigrate {step}" in out or step in out
    assert out.count("== step") == 8
    assert "Every source file is unchanged" in out
    html = (tmp_path / "d" / "report.html").read_text()
    assert "<svg" in html
    # rollback removed the target namespaces the apply created: only the sample's folders remain
    from kvmigrate.synth.demo import build_demo_root

    build_demo_root(tmp_path / "fresh")
    left = {n for n in os.listdir(tmp_path / "d" / "cache") if n != ".kvmigrate"}
    assert left == set(os.listdir(tmp_path / "fresh"))


def test_demo_refuses_a_nonempty_cache_folder(tmp_path):
    (tmp_path / "d" / "cache").mkdir(parents=True)
    (tmp_path / "d" / "cache" / "x").write_text("keep me")
    proc = subprocess.run([sys.executable, "-m", "kvmigrate", "demo", str(tmp_path / "d")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 8
    assert "not empty" in proc.stderr
    assert (tmp_path / "d" / "cache" / "x").read_text() == "keep me"
