"""docs/scheduling.md ships working schedules: the systemd unit and timer pass
`systemd-analyze verify`, the crontab line runs (flock and all) and writes its textfile,
and the Kubernetes CronJob parses, mounts the cache read-only and uses --baseline auto."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

DOC = Path(__file__).resolve().parents[2] / "docs" / "scheduling.md"
KVMIGRATE = str(Path(sys.executable).with_name("kvmigrate"))


def shipped() -> dict[str, str]:
    """The files of the doc: each fenced block after a `<!-- file: NAME -->` marker."""
    return dict(re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", DOC.read_text(), re.S))


def test_systemd_unit_and_timer_verify(tmp_path):
    files = shipped()
    for name in ("kvmigrate-audit.service", "kvmigrate-audit.timer"):
        (tmp_path / name).write_text(files[name].replace("/usr/local/bin/kvmigrate", KVMIGRATE))
    proc = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "kvmigrate-audit.service"),
                           str(tmp_path / "kvmigrate-audit.timer")], capture_output=True, text=True)
    assert proc.returncode == 0 and "Unknown" not in proc.stderr, proc.stderr
    assert "--baseline auto" in files["kvmigrate-audit.service"]


def test_crontab_line_runs_under_flock_and_writes_the_textfile(synth_root, tmp_path):
    root, _ = synth_root(dict(family="llmd", tp=2, kv_kind="mla"))
    line = shipped()["crontab"].strip()
    fields = line.split(None, 5)
    assert len(fields) == 6 and fields[:5] == ["30", "3", "*", "*", "*"]
    argv = shlex.split(fields[5])
    assert argv[:3] == ["flock", "-n", "/run/lock/kvmigrate-audit.lock"] and "--baseline" in argv
    textfile, report = tmp_path / "kvmigrate.prom", tmp_path / "audit.txt"
    argv = [a.replace("/run/lock/", f"{tmp_path}/").replace("/cache", str(root))
            .replace("/var/lib/node_exporter/textfile/kvmigrate.prom", str(textfile))
            .replace("/var/log/kvmigrate/audit.txt", str(report)) for a in argv]
    argv[3] = KVMIGRATE
    argv += ["--model-dtype", "bfloat16", "--kv-kind", "mla"]
    for _ in range(2):  # the second run carries the first one's hashes over
        proc = subprocess.run(argv, capture_output=True, text=True)
        assert proc.returncode in (0, 1), proc.stderr
    rows = {s.labels["source"]: s.value for f in text_string_to_metric_families(textfile.read_text())
            for s in f.samples if s.name == "kvmigrate_rows"}
    assert rows["carried"] > 0 and report.read_text()


def test_kubernetes_cronjob_mounts_the_cache_read_only():
    job = yaml.safe_load(shipped()["cronjob.yaml"])
    assert job["kind"] == "CronJob" and job["apiVersion"] == "batch/v1"
    assert job["spec"]["concurrencyPolicy"] == "Forbid"
    pod = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[:2] == ["audit", "/cache"] and args[args.index("--baseline") + 1] == "auto"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/cache"]["readOnly"] is True
    history = args[args.index("--history") + 1]
    textfile = args[args.index("--prometheus") + 1]
    writable = [p for p, m in mounts.items() if not m.get("readOnly")]
    assert any(history.startswith(p + "/") for p in writable) and any(textfile.startswith(p + "/") for p in writable)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/cache"]["name"]]["persistentVolumeClaim"]["readOnly"] is True
