"""The default command gives no engine a wrong block, whatever the tree holds.

Every synth family and era, each with every defect the generator can inject into it (one
defect per tree), is migrated by the command a user types first, `kvmigrate migrate ROOT
--apply` (no --verify: its own scan hashes), and the reference reader
(tests/helpers/reference_reader.py) then loads every block file in every target rank folder the
migration made, the way the target engine does: each must hold exactly the row (vLLM) or
payload (vllm.cpp) the source writer stored for that key, rebuilt from
`synth.page_bytes_for`, never crash residue, a differing replica, a cut file or a block of
another identity. (Blocks that are absent are misses, which an engine survives.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvmigrate import manifest
from kvmigrate.cli import cli

from helpers.reference_reader import ReferenceReader, expected_vllmcpp_payload, row_page_errors, vllm034_base
from helpers.synth_matrix import ERAS, GEOMETRY, cases

pytestmark = pytest.mark.slow

CASES = cases()


def wrong_reads(root: Path, meta: dict, res) -> tuple[list[str], int]:
    """What the target engine would read wrongly from the target rank folders this
    migration made (not the source folders of a namespace already in place), and how
    many blocks it loaded."""
    synth_ns = {ns["base_name"]: ns for ns in res.namespaces}
    source_dirs = {d for ns in meta["namespaces"].values() for d in ns.get("rank_dirs") or ()}
    by_target: dict[str, list[dict]] = {}
    errors, loaded = [], 0
    for base, ns in meta["namespaces"].items():
        target = ns.get("target")
        if target and target.get("base_name") and base in synth_ns and target["rank_dir"] not in source_dirs:
            by_target.setdefault(target["base_name"], []).append((synth_ns[base], target))
            writer = synth_ns[base]
            if meta["target_profile"] == "vllm-0.34" and writer["family"] == "vllm" \
                    and target["base_name"] != vllm034_base(writer):
                errors.append(f"{base}: placed into {target['base_name']}, but vLLM 0.34 reads "
                              f"{vllm034_base(writer)} for the deployment that wrote it")
    for sources in by_target.values():
        ns, target = min(sources, key=lambda s: min(s[0]["ranks"]))  # MLA: rank 0's bytes are every rank's
        reader = ReferenceReader(root, target)
        for hex_hash, group in sorted(reader.keys_on_disk()):
            loaded += 1
            if target["family"] == "vllmcpp":
                got = reader.load(hex_hash, group)
                want = expected_vllmcpp_payload(ns, hex_hash, group, int(target["fields"]["rank"]))
                if got.data != want:
                    errors.append(f"{got.path}: " + (f"not loaded ({got.why})" if got.data is None
                                                     else "not the payload the source writer stored"))
            else:
                cells = 1 if target.get("replicated_layout") else ns["tp"]
                errors += row_page_errors(reader, ns, hex_hash, group, cells=cells)
    return errors, loaded


@pytest.mark.parametrize("era,defect", CASES, ids=[f"{e}-{d}" for e, d in CASES])
def test_the_default_migration_gives_the_engine_no_wrong_block(tmp_path, synth_root, era, defect):
    spec, facts = ERAS[era]
    root, (res,) = synth_root({**GEOMETRY, **spec, "defects": (defect,)})
    m = tmp_path / "m.parquet"
    result = CliRunner().invoke(cli, ["migrate", str(root), *facts, "--manifest-out", str(m), "--apply", "--json"],
                                catch_exceptions=False)
    assert not result.exit_code & 8, result.output
    summary = json.loads(result.stdout)
    # the scan hashed every block: the apply meets no finding the dry run did not show
    assert summary["outcomes"]["failed"] == 0, summary["apply"]["findings"]
    errors, loaded = wrong_reads(root, manifest.read_metadata(m), res)
    assert errors == []
    assert loaded == summary["outcomes"]["created"]  # every block it created was loaded and compared
