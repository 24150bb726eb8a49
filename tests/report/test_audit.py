"""`kvmigrate audit ROOT` over synthetic trees: one tree per defect gives the documented
exit code (interface.md §2/§4) and a hint naming the command that deals with it."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvmigrate import layout
from kvmigrate.cli import cli
from kvmigrate.synth.spec import BLOCK_DEFECTS, TREE_DEFECTS, SynthSpec
from kvmigrate.synth.tree import build

# interface.md §2, written out here (not imported) so the test checks the code against the spec
DOCUMENTED_BITS = {
    "incomplete": 1, "replica_mismatch": 5, "size_mismatch": 5, "padded_legacy": 1, "short": 5,
    "zero_filled": 5, "misfiled": 5, "header_invalid": 5, "unreadable": 9, "tmp_leftover": 1, "foreign": 1,
    "orphan_namespace": 1, "digest_mismatch": 5, "config_invalid": 5, "unsupported_layout": 1,
}

SMALL = dict(blocks=3, page_bytes=64, layers=2)
DTYPE = ["--model-dtype", "bfloat16"]
# the facts the vLLM 0.28 gate needs: without them a target is a guess (no apply hint)
DECIDED = ["--kv-kind", "full", "--total-kv-heads", "8", "--writer-tp", "1", "--writer-pp", "1"]
# defect -> (spec changes, fact flags the scanner needs to see the defect)
CASES = {
    "missing_rank": (dict(family="llmd", tp=2), DTYPE),
    "replica_differs": (dict(family="llmd", tp=2, kv_kind="mla"), DTYPE + ["--kv-kind", "mla"]),
    "padded_legacy": (dict(family="llmd", tp=2), DTYPE + ["--kv-kind", "full", "--page-bytes", "64",
                                                          "--tensors-per-layer", "2"]),
    "pp_stage": (dict(family="llmd", tp=1, pp=2), DTYPE),
    **{d: (dict(family="vllmcpp"), DTYPE) for d in BLOCK_DEFECTS if d.startswith("header_")},
}
ALL_DEFECTS = [d for d in list(BLOCK_DEFECTS) + list(TREE_DEFECTS)]


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def make_tree(tmp_path: Path, defect: str | None, **changes):
    changes = {**SMALL, **changes}
    spec = SynthSpec(defects=(defect,) if defect else (), **changes)
    root = tmp_path / "root"
    return root, build(root, spec)


def expected_hint(status: str, manifest: Path, root: Path, base: str, flags: list[str] = ()) -> str:
    if status in ("digest_mismatch", "config_invalid"):
        return f"kvmigrate identity {root}/{base}/config.json"
    if status == "tmp_leftover":
        return " ".join(["kvmigrate prune", str(root), *flags, "--residue"])  # a dry run: never a hand-run rm
    if status == "orphan_namespace":  # that folder only (--unreadable-namespaces alone takes every one)
        return " ".join(["kvmigrate prune", str(root), *flags, "--unreadable-namespaces", "--only", base])
    return f"kvmigrate report {manifest} --list {status}"


def audit_json(root: Path, manifest: Path, flags: list[str]) -> tuple[int, dict]:
    res = run("audit", str(root), "--manifest-out", str(manifest), "--verify", "hash", "--json", *flags)
    return res.exit_code, json.loads(res.stdout)


@pytest.mark.parametrize("defect", ALL_DEFECTS)
def test_each_defect_exit_code_and_hint(tmp_path, defect, monkeypatch):
    changes, flags = CASES.get(defect, ({}, DTYPE))
    root, result = make_tree(tmp_path, defect, **changes)
    record = result.defect(defect)
    status = record["status"]
    if defect == "unreadable":
        # root reads a chmod-000 file anyway: make the victim fail the way it would for a user
        from kvmigrate import fsio

        real_open = fsio.open_noatime
        victim = str(root / record["relpath"])

        def denied(path):
            if path == victim:
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return real_open(path)

        monkeypatch.setattr(fsio, "open_noatime", denied)
        monkeypatch.setenv("KVMIGRATE_PURE_PYTHON", "1")  # a Python-level fault: only the Python walk meets it
    manifest = tmp_path / "m.parquet"
    code, summary = audit_json(root, manifest, flags)
    assert status in summary["totals"]["by_status"], summary["totals"]["by_status"]
    assert code == DOCUMENTED_BITS[status] == summary["exit_code"]
    commands = [h["command"] for h in summary["hints"]]
    base = record["base_name"]
    if status == "orphan_namespace" and base is None:  # orphan_rank records its rank folder only
        base = layout.parse_folder(record["relpath"].split("/")[0]).base
    want = expected_hint(status, manifest, root, base, flags)
    assert want in commands, commands
    hint = next(h for h in summary["hints"] if h["command"] == want)
    assert status in hint["codes"]
    # the human report prints the same command
    text = run("audit", str(root), "--manifest-out", str(manifest), "--verify", "hash", *flags).stdout
    assert want in text


def test_pending_work_exits_1_and_hints_the_migration(tmp_path):
    root, _ = make_tree(tmp_path, None, family="vllm", scheme="S1")
    manifest = tmp_path / "m.parquet"
    code, summary = audit_json(root, manifest, DTYPE + DECIDED)  # (without the gate facts the target is a guess)
    assert code == 1
    assert summary["totals"]["pending"]["blocks"] == 3
    assert [h["command"] for h in summary["hints"]] == [f"kvmigrate migrate --manifest {manifest} --apply"]


def test_already_migrated_tree_has_nothing_to_do(tmp_path):
    root, _ = make_tree(tmp_path, None, family="vllm", scheme="S3", dtype="bfloat16")  # what 0.34 writes at TP1
    res = run("audit", str(root), *DECIDED)
    assert res.exit_code == 0
    assert "nothing to do" in res.stdout


def test_missing_fact_exits_1_and_names_the_flag(tmp_path):
    root, _ = make_tree(tmp_path, None, family="vllm", scheme="S1")  # dtype "auto": needs --model-dtype
    res = run("audit", str(root), "--json")
    summary = json.loads(res.stdout)
    assert res.exit_code == 1
    assert summary["namespaces"][0]["target_error"]
    assert f"kvmigrate audit {root} --model-dtype <bfloat16|float16>" in [h["command"] for h in summary["hints"]]


def test_unverified_replicas_hint_verify_hash(tmp_path):
    root, _ = make_tree(tmp_path, None, family="llmd", tp=2, kv_kind="mla")
    target = ["--kv-kind", "mla"] + DTYPE
    manifest = tmp_path / "m.parquet"
    res = run("audit", str(root), "--json", "--manifest-out", str(manifest), *target)
    summary = json.loads(res.stdout)
    codes = {f["code"] for f in summary["findings"]}
    assert "replicas_unverified" in codes
    want = (f"kvmigrate audit {root} --kv-kind mla --model-dtype bfloat16 --verify hash "
            f"--manifest-out {manifest}")
    assert want in [h["command"] for h in summary["hints"]]
    # once hashed, the hint is gone
    summary = json.loads(run("audit", str(root), "--json", "--verify", "hash", *target).stdout)
    assert "replicas_unverified" not in {f["code"] for f in summary["findings"]}


def test_ambiguous_family_that_matters_hints_family(tmp_path):
    # vLLM S1 with tp=2: one _r0 folder whose rows hold 2 cells; llm-d would read it differently
    root, _ = make_tree(tmp_path, None, family="vllm", scheme="S1", tp=2, page_bytes=4096)
    summary = json.loads(run("audit", str(root), "--json", *DTYPE).stdout)
    n = summary["namespaces"][0]
    assert n["family"] == "ambiguous"
    assert n["flags_asked"]["none"]["--family"] == 3
    assert f"kvmigrate audit {root} --model-dtype bfloat16 --family <vllm|llmd>" in [
        h["command"] for h in summary["hints"]]
    # once told, the namespace is planned and the hint is gone
    summary = json.loads(run("audit", str(root), "--json", *DTYPE, "--family", "vllm").stdout)
    assert all("--family <" not in h["command"] for h in summary["hints"])


def test_target_aliasing_the_source_hints_dest(tmp_path):
    # an llm-d tree read with the vllm-0.22 profile: same S1 names, other bytes
    root, _ = make_tree(tmp_path, None, family="llmd", tp=1, page_bytes=100)
    summary = json.loads(run("audit", str(root), "--json", "--target", "vllm-0.22").stdout)
    if not any(n["aliases_source_blocks"] for n in summary["namespaces"]):
        pytest.fail(f"expected aliases_source blocks, got {summary['namespaces'][0]['top_reasons']}")
    assert any("--dest <DIR> --apply" in h["command"] for h in summary["hints"])


def test_audit_without_manifest_out_leaves_nothing_behind(tmp_path, monkeypatch):
    root, _ = make_tree(tmp_path, "short", family="vllm", scheme="S3", dtype="bfloat16")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    res = run("audit", str(root), "--format", "md")
    assert res.exit_code == 5
    assert res.stdout.startswith("# kvmigrate report")
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    assert list(work.iterdir()) == []
    # the hint cannot point at a temporary manifest: it says how to write one
    assert f"rm -f kvmigrate-manifest.parquet; kvmigrate scan {root} -o kvmigrate-manifest.parquet; kvmigrate " \
           "report kvmigrate-manifest.parquet --list short" in res.stdout


def test_audit_report_to_file_and_html(tmp_path):
    root, _ = make_tree(tmp_path, "foreign", family="vllm", scheme="S3", dtype="bfloat16")
    out = tmp_path / "audit.html"
    res = run("audit", str(root), "--format", "html", "-o", str(out), "-q")
    assert res.exit_code == 1
    assert res.stdout == ""
    assert out.read_text().startswith("<!DOCTYPE html>")


def test_audit_of_a_missing_root_is_a_usage_error(tmp_path):
    res = CliRunner().invoke(cli, ["audit", str(tmp_path / "nope")])
    assert res.exit_code == 2
    assert "does not exist" in res.output and "Traceback" not in res.output


def _prometheus(path: Path) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(path.read_text()) for s in f.samples}


def _last_success(samples: dict[tuple, float]) -> list[float]:
    return [v for (name, _), v in samples.items() if name == "kvmigrate_last_success_timestamp_seconds"]


@pytest.mark.parametrize("holds", ["nothing", "own_folder_only", "foreign_only"])
def test_a_root_holding_no_cache_is_an_operational_error(tmp_path, holds):
    # an empty or unmounted root audited clean (exit 0, "nothing to do") and the textfile
    # got a fresh last-success time: a volume that failed to mount alerted green
    root = tmp_path / "cache"
    root.mkdir()
    if holds == "own_folder_only":
        (root / ".kvmigrate" / "audits").mkdir(parents=True)
    if holds == "foreign_only":
        (root / "lost+found").mkdir()
        (root / "README").write_text("mount the cache volume here\n")
    prom = tmp_path / "kvmigrate.prom"
    res = run("audit", str(root), "--prometheus", str(prom), "--json")
    summary = json.loads(res.stdout)
    assert res.exit_code == (9 if holds == "foreign_only" else 8), res.stderr
    assert summary["exit_code"] == res.exit_code and summary["no_cache"] is True
    found = next(f for f in summary["findings"] if f["code"] == "no_cache")
    assert found["severity"] == "operational" and found["bits"] == 8
    assert found["message"].startswith(f"nothing here: is it mounted? {root} holds no cache")
    assert f"kvmigrate: error: nothing here: is it mounted? {root}" in res.stderr
    samples = _prometheus(prom)
    assert samples[("kvmigrate_exit_bit", (("bit", "operational"), ("root", str(root))))] == 1
    assert _last_success(samples) == []  # never a success: no earlier one to carry either
    text = run("audit", str(root), "-q")
    assert text.exit_code == res.exit_code and text.stdout == ""
    assert text.stderr.startswith(f"kvmigrate: error: nothing here: is it mounted? {root}")


def test_an_unmounted_root_keeps_the_last_success_time_of_the_textfile(tmp_path):
    # the textfile keeps the time of the last good audit, so `time() - last_success` grows
    root, _ = make_tree(tmp_path, None, family="vllm", scheme="S3", dtype="bfloat16")
    prom = tmp_path / "kvmigrate.prom"
    assert run("audit", str(root), "--prometheus", str(prom)).exit_code & 8 == 0
    (good,) = _last_success(_prometheus(prom))
    aside = tmp_path / "aside"
    aside.mkdir()
    for entry in list(root.iterdir()):  # the volume is gone: its mount point is an empty folder
        entry.rename(aside / entry.name)
    res = run("audit", str(root), "--prometheus", str(prom))
    assert res.exit_code == 8 and "nothing here: is it mounted?" in res.stdout
    samples = _prometheus(prom)
    assert _last_success(samples) == [good]
    assert samples[("kvmigrate_exit_code", (("root", str(root)),))] == 8


def test_a_scan_of_an_empty_root_and_its_report_say_nothing_is_there(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    m = tmp_path / "m.parquet"
    res = run("scan", str(root), "-o", str(m), "-q")
    assert res.exit_code == 8 and res.stdout == ""
    assert res.stderr.startswith(f"kvmigrate: error: nothing here: is it mounted? {root} holds no cache")
    rep = run("report", str(m))
    assert rep.exit_code == 8
    assert f"nothing here: is it mounted? {root}" in rep.stdout and "exit code            8" in rep.stdout


@pytest.mark.parametrize("holds", ["orphan_rank", "sglang_temp", "excluded"])
def test_a_root_with_cache_files_is_no_empty_root(tmp_path, holds):
    """What an engine left (a rank folder, a HiCache temp file), or namespaces a filtered
    scan left out, are a cache: not "nothing here"."""
    root = tmp_path / "cache"
    root.mkdir()
    args = []
    if holds == "orphan_rank":
        import shutil

        result = build(root, SynthSpec(**SMALL, defects=("orphan_rank",)))
        orphan = result.defects[0]["relpath"].split("/")[0]
        for entry in root.iterdir():  # the orphaned rank folder alone
            if entry.name != orphan:
                shutil.rmtree(entry)
    elif holds == "sglang_temp":
        (root / ("a" * 64 + "_m_0_1.bin.tmp.12.34.1a2b")).write_bytes(b"x" * 64)
    else:
        build(root, SynthSpec(**SMALL))
        args = ["--exclude", "*"]
    res = run("audit", str(root), "--json", *args)
    summary = json.loads(res.stdout)
    assert res.exit_code & 8 == 0 and summary["no_cache"] is False, res.stdout
    assert "no_cache" not in [f["code"] for f in summary["findings"]]


@pytest.mark.parametrize("apply", [False, True])
def test_migrate_of_an_empty_root_says_nothing_is_there_and_writes_nothing(tmp_path, apply):
    root = tmp_path / "cache"
    root.mkdir()
    res = run("migrate", str(root), *(["--apply"] if apply else []))
    assert res.exit_code == 8, res.output
    assert res.stderr.startswith(f"kvmigrate: error: nothing here: is it mounted? {root} holds no cache")
    assert list(root.iterdir()) == []  # no journal folder made in an empty mount point


def test_a_shard_other_than_part_0_never_says_nothing_is_there(tmp_path):
    """A flat directory's pages are part 0's: part 1 of 2 of a HiCache root has no rows."""
    root = tmp_path / "cache"
    build(root, SynthSpec(family="sglang", blocks=3, layers=2))
    part1 = run("scan", str(root), "-o", str(tmp_path / "p1.parquet"), "--shard", "1/2", "-q")
    assert part1.exit_code & 8 == 0 and part1.stderr == ""
    assert run("scan", str(root), "-o", str(tmp_path / "p0.parquet"), "--shard", "0/2", "-q").exit_code & 8 == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run("scan", str(empty), "-o", str(tmp_path / "e0.parquet"), "--shard", "0/2", "-q").exit_code == 8
