"""Shared test fixtures. Keep each fixture small and documented; add yours below.

`synth_root`  a factory that builds synthetic cache trees (kvmigrate.synth) under a fresh
              root in tmp_path and returns (root, [SynthResult, ...]).
`scan_root`   a helper that scans a root into a manifest in tmp_path (outside the root)
              and returns (ScanResult, rows), rows being the manifest as dicts keyed by
              relpath.
`walk`        runs a test once per leaf walk (helpers.WALKS); `python_walk` the Python one.
`ray`         the `ray` module: skips where the extra is not installed, fails under CI.
`no_limits`   resets kvmigrate.pacing's process-wide limits after a test.
`tmpdir_of_scan`         the folder a scan's temporary files go to (TMPDIR), in tmp_path.
`scan_with_full_tmpdir`  scans a root whose every write into `tmpdir_of_scan` fails
              (ENOSPC) and checks what a spill's failed write must give.

Plain values and functions the tests import (SMALL, WALKS, FakeClock, the CLI runner, the
reference readers, ...) live in tests/helpers/ (`from helpers import SMALL`), not here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from helpers import SMALL, WALKS


@pytest.fixture
def synth_root(tmp_path: Path) -> Callable[..., tuple[Path, list]]:
    """build(*specs, root_name="root") -> (root, results): each spec is a SynthSpec or a
    dict of SynthSpec fields (SMALL geometry unless overridden); all go in one root."""
    from kvmigrate.synth import SynthSpec, build

    def make(*specs: Any, root_name: str = "root") -> tuple[Path, list]:
        root = tmp_path / root_name
        root.mkdir(exist_ok=True)
        results = []
        for spec in specs:
            if isinstance(spec, dict):
                spec = SynthSpec(**{**SMALL, **spec})
            results.append(build(root, spec))
        return root, results

    return make


@pytest.fixture
def scan_root(tmp_path: Path) -> Callable[..., tuple[Any, dict[str, dict]]]:
    """scan(root, *, flags=None, facts_file=None, **scan_kwargs) -> (ScanResult, rows by
    relpath). Facts flags are a dict like {"kv_kind": "mla", "page_bytes": 256}."""
    from kvmigrate import manifest
    from kvmigrate.identity.facts import FactsResolver
    from kvmigrate.options import ScanOptions
    from kvmigrate.pipeline import scan

    counter = {"n": 0}

    def run(root: Path, *, flags: dict | None = None, facts_file: str | None = None,
            **kwargs: Any) -> tuple[Any, dict[str, dict]]:
        counter["n"] += 1
        out = tmp_path / f"manifest-{counter['n']}.parquet"
        kwargs.setdefault("threads", 2)
        result = scan(root, out, ScanOptions(facts_resolver=FactsResolver(flags or {}, facts_file), **kwargs))
        rows = {r["relpath"]: r for r in manifest.read_table(out).to_pylist()}
        return result, rows

    return run


@pytest.fixture(params=WALKS)
def walk(request, monkeypatch) -> str:
    """Run the test once per leaf walk (in-process scans and subprocesses alike read
    KVMIGRATE_PURE_PYTHON when a walk starts)."""
    if request.param == "python":
        monkeypatch.setenv("KVMIGRATE_PURE_PYTHON", "1")
    else:
        import kvmigrate._leafwalk  # noqa: F401  (fails here, clearly, where it was not built)

        monkeypatch.delenv("KVMIGRATE_PURE_PYTHON", raising=False)
    return request.param


@pytest.fixture
def python_walk(monkeypatch) -> None:
    """For faults injected by monkeypatching Python functions (os.open, open_noatime): only
    the Python walk calls them. The C walk meets the same faults for real in the
    unprivileged-user tests and through the LD_PRELOAD race shim (tests/scan/test_leaf_walk.py)."""
    monkeypatch.setenv("KVMIGRATE_PURE_PYTHON", "1")


@pytest.fixture(scope="session")
def ray():
    """The `ray` module, for the tests that start a cluster (the `ray` extra). Where the
    extra is not installed they are skipped, naming the install command; under CI
    (CI=true, set by .ci/run, which installs the extra) a missing Ray fails them instead,
    so they never silently do not run."""
    if os.environ.get("CI", "").lower() in ("", "0", "false"):
        return pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[test,ray]'")
    import ray

    return ray


@pytest.fixture(scope="module")
def ray_cluster(ray):
    """One local cluster per module (the scale-out tests); the commands find it initialized and use it."""
    from kvmigrate.scaleout.ray_runner import LOCAL_OBJECT_STORE_BYTES

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=LOCAL_OBJECT_STORE_BYTES)
    yield ray
    ray.shutdown()


@pytest.fixture
def no_limits():
    """Reset kvmigrate.pacing's process-wide limits and clock after a test that set them."""
    from kvmigrate import pacing

    yield
    pacing._LIMITS.clock = pacing.time.monotonic
    pacing.configure()


@pytest.fixture
def tmpdir_of_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder the scan's temporary files go to (TMPDIR)."""
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


@pytest.fixture
def scan_with_full_tmpdir(tmp_path: Path, tmpdir_of_scan: Path, monkeypatch: pytest.MonkeyPatch
                          ) -> Callable[[Path], str]:
    """scan(root) -> the output of `kvmigrate scan` of root when every file it writes into
    TMPDIR fails as on a full disk: one check for every spill (store, tier) that such a
    scan stops with exit 8 naming TMPDIR, writes no manifest and leaves TMPDIR empty."""
    import errno
    import gc

    import pyarrow as pa

    from helpers.cli_helpers import run

    def scan(root: Path) -> str:
        opened = pa.OSFile

        def full(path: Any, mode: str = "rb") -> Any:
            if mode != "rb" and str(path).startswith(str(tmpdir_of_scan)):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return opened(path, mode)

        monkeypatch.setattr(pa, "OSFile", full)
        code, text = run("scan", root, "-o", tmp_path / "m.parquet")
        assert code == 8, text
        assert str(tmpdir_of_scan) in text and "TMPDIR" in text
        assert not (tmp_path / "m.parquet").exists()
        gc.collect()
        assert list(tmpdir_of_scan.iterdir()) == []
        return text

    return scan
