"""`audit --keep N` history, `report --diff` against the previous kept audit, `report
--trend`, `audit --prometheus FILE` (parsed by prometheus_client) and `--log-format json`."""

from __future__ import annotations

import json
import os

from prometheus_client.parser import text_string_to_metric_families

from kvmigrate import history, manifest

from helpers.cli_helpers import run

FACTS = ["--model-dtype", "bfloat16", "--kv-kind", "mla"]
SPEC = dict(family="llmd", tp=2, kv_kind="mla", blocks=8)


def audit(root, *extra):
    return run("audit", root, "--verify", "hash", "-q", *FACTS, *extra)


def test_keep_holds_the_last_n_audits_and_baseline_auto_uses_the_newest(synth_root, tmp_path):
    root, _ = synth_root(SPEC)
    kept_dir = root / ".kvmigrate" / "audits"
    for _ in range(3):
        audit(root, "--keep", "2", "--baseline", "auto")
    kept = history.kept_audits(kept_dir)
    assert len(kept) == 2 and not [p for p in kept_dir.iterdir() if p.name.endswith(".tmp")]
    first, second = (manifest.read_metadata(p) for p in kept)
    assert second["baseline"]["path"] == str(kept[0])  # the third run's baseline: the second's manifest
    assert first["baseline"] is not None  # (the first run of all had none; it was pruned)
    carried = [r for r in manifest.read_table(kept[1]).to_pylist() if r["carried"]]
    assert len(carried) > 0


def test_keep_with_history_dir_leaves_the_root_alone(synth_root, tmp_path):
    root, _ = synth_root(SPEC)
    hist = tmp_path / "hist"
    audit(root, "--keep", "5", "--history", hist)
    audit(root, "--keep", "5", "--history", hist, "--baseline", "auto")
    assert len(history.kept_audits(hist)) == 2 and not (root / ".kvmigrate").exists()


def test_report_diff_defaults_to_the_previous_kept_audit(synth_root, tmp_path):
    root, _ = synth_root(SPEC)
    hist = tmp_path / "hist"
    audit(root, "--keep", "3", "--history", hist)
    (root / "notes.txt").write_text("a foreign file\n")
    audit(root, "--keep", "3", "--history", hist)
    old, new = history.kept_audits(hist)
    _, out = run("report", "--diff", new, "--format", "json")
    d = json.loads(out)
    assert d["old"]["manifest"] == str(old) and d["new"]["manifest"] == str(new)
    code, out = run("report", "--diff", "--history", hist)
    assert str(old) in out and str(new) in out
    code, out = run("report", "--diff", old)
    assert code == 2 and "no earlier kept audit" in out


def test_report_trend_lists_every_kept_audit(synth_root, tmp_path):
    root, _ = synth_root(SPEC)
    hist = tmp_path / "hist"
    audit(root, "--keep", "3", "--history", hist)
    (root / "notes.txt").write_text("a foreign file\n")
    audit(root, "--keep", "3", "--history", hist)
    code, out = run("report", "--trend", "--history", hist, "--format", "json")
    tr = json.loads(out)
    assert code == 0 and [a["manifest"] for a in tr["audits"]] == [str(p) for p in history.kept_audits(hist)]
    assert "foreign" not in tr["audits"][0]["by_status"] and tr["audits"][1]["by_status"]["foreign"]["files"] == 1
    code, out = run("report", "--trend", "--history", hist)
    assert code == 0 and "foreign files" in out and len(out.strip().splitlines()) == 3


def test_prometheus_textfile_parses_and_carries_the_audit(synth_root, tmp_path):
    root, _ = synth_root(SPEC)
    prom = tmp_path / "textfile" / "kvmigrate.prom"
    hist = tmp_path / "hist"
    audit(root, "--keep", "2", "--history", hist)
    (root / "notes.txt").write_text("a foreign file\n")
    code, _ = audit(root, "--keep", "2", "--history", hist, "--baseline", "auto", "--prometheus", prom)
    assert sorted(os.listdir(prom.parent)) == ["kvmigrate.prom"]  # (temp + rename: no temp left)
    families = {f.name: f for f in text_string_to_metric_families(prom.read_text())}
    assert all(f.type == "gauge" for f in families.values())
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    rows = {dict(k[1])["source"]: v for k, v in samples.items() if k[0] == "kvmigrate_rows"}
    table = manifest.read_table(history.kept_audits(hist)[-1]).to_pylist()
    assert rows == {"carried": sum(r["carried"] for r in table), "read": sum(not r["carried"] for r in table)}
    assert rows["carried"] > 0
    assert [v for (n, _), v in samples.items() if n == "kvmigrate_exit_code"] == [code]
    foreign = [v for (n, labels), v in samples.items() if n == "kvmigrate_files" and ("status", "foreign") in labels]
    assert foreign == [1]
    assert "kvmigrate_last_success_timestamp_seconds" in families
    findings = {dict(k[1])["class"]: v for k, v in samples.items() if k[0] == "kvmigrate_findings"}
    assert set(findings) == {"integrity", "operational", "finding"} and findings["finding"] >= 1


def test_prometheus_textfile_passes_promtool(synth_root, tmp_path):
    """Debian's prometheus package ships promtool (.ci/run installs it): its linter checks
    names, types, HELP lines and label syntax the way Prometheus reads them."""
    import subprocess

    root, _ = synth_root(SPEC, dict(family="vllm", tp=1, defects=("tmp_vllm",)))
    prom = tmp_path / "kvmigrate.prom"
    audit(root, "--prometheus", prom)
    proc = subprocess.run(["promtool", "check", "metrics"], input=prom.read_text(), capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), proc.stdout + proc.stderr


def test_prometheus_label_values_are_escaped():
    from kvmigrate.report.prometheus import textfile

    summary = {"root": 'C:\\cache "x"\nnext', "namespaces": [], "outside_namespaces": None, "exit_code": 0,
               "totals": {"files": 0, "by_status": {}}}
    fams = list(text_string_to_metric_families(textfile(summary, seconds=1.5, carried=0, now=10.0)))
    roots = {s.labels["root"] for f in fams for s in f.samples}
    assert roots == {'C:\\cache "x"\nnext'}


def test_log_format_json_writes_one_object_per_event(synth_root, tmp_path):
    from click.testing import CliRunner

    from kvmigrate.cli import cli

    root, _ = synth_root(SPEC)
    res = CliRunner().invoke(cli, ["audit", str(root), "--verify", "hash", "-q", *FACTS, "--log-format", "json"],
                             catch_exceptions=False)
    events = [json.loads(line) for line in res.stderr.splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end" and "findings" in kinds and kinds.count("namespace") == 1
    assert events[-1]["exit_code"] == res.exit_code


def test_report_trend_html_renders_in_headless_chromium(synth_root, tmp_path):
    import shutil
    import subprocess

    root, _ = synth_root(SPEC)
    hist = tmp_path / "hist"
    audit(root, "--keep", "3", "--history", hist)
    (root / "notes.txt").write_text("a foreign file\n")
    audit(root, "--keep", "3", "--history", hist)
    page = tmp_path / "trend.html"
    code, _ = run("report", "--trend", "--history", hist, "--format", "html", "-o", page)
    assert code == 0
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "headless Chromium not found: apt-get install -y chromium (.ci/run installs it)"
    res = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          "--disable-dev-shm-usage", "--host-resolver-rules=MAP * ~NOTFOUND",
                          f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    assert 'id="svg-trend"' in dom and 'class="status-foreign"' in dom
    for p in history.kept_audits(hist):
        assert p.name in dom
