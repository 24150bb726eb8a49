"""The plan as data: built from small hand-written manifests over real files.

These tests do not depend on the scanner: each writes a manifest with
`ManifestWriter` whose rows describe files created in tmp_path, so every planning rule
(merge order, counting, path checks, the shell form) is tested on its own.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import xxhash

from kvmigrate import findings, layout
from kvmigrate.errors import UsageError
from kvmigrate.identity import canonical
from kvmigrate.manifest import ManifestWriter
from kvmigrate.migrate.actions import render_commands, render_text
from kvmigrate.migrate.apply import apply_plan
from kvmigrate.migrate.plan import ALREADY_AT_ROOT, build_plan


def _fields(model: str, tp: int) -> dict:
    return {"model_name": model, "tp_size": tp, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "auto",
            "kv_cache_groups": [{"block_size": 16, "layer_names": ["l0"]}], "inference_engine": "vllm",
            "hash_block_size": 16, "gpu_blocks_per_file": 1}


def _target(model: str) -> dict:
    fields = {"model_name": model, "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1,
              "dtype": "bfloat16", "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["l0"]}],
              "inference_engine": "vllm", "tokens_per_hash": 16, "blocks_per_file": 1}
    base = layout.base_name(model, canonical.d12(fields, "vllm"))
    return {"profile": "vllm-0.28", "family": "vllm", "fields": fields, "d12": canonical.d12(fields, "vllm"),
            "base_name": base, "rank_dir": layout.rank_dir_name(base, 0)}


class Tree:
    """Source namespaces written by hand, and the manifest describing them."""

    def __init__(self, root):
        self.root = root
        self.namespaces: dict[str, dict] = {}
        self.rows: list[dict] = []

    def namespace(self, model: str, tp: int, *, family: str = "vllm", target: dict | None = None) -> str:
        fields = _fields(model, tp)
        base = layout.base_name(model, canonical.d12(fields, "vllm"))
        (self.root / base).mkdir()
        (self.root / base / "config.json").write_bytes(canonical.config_json_bytes(fields, "vllm"))
        self.namespaces[base] = {"family": family, "config_json": fields, "ranks": list(range(tp)),
                                 "deployment": base, "target": target if target is not None else _target(model)}
        return base

    def block(self, base: str, hex_hash: str, data: bytes, *, action: str, rank: int = 0, reason: str = "",
              target: bool = True, finding: str | None = None) -> str:
        """`finding`: the row's finding code (what the plan reads; `reason` is prose)."""
        rel = layout.block_relpath(base, rank, hex_hash, 0)
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        st = os.stat(path)
        tgt = self.namespaces[base]["target"]
        self.rows.append({"relpath": rel, "family": self.namespaces[base]["family"], "source_base": base,
                          "deployment": base, "target_base": tgt["base_name"] if tgt else None, "rank": rank,
                          "group": 0, "block_hash": bytes.fromhex(hex_hash), "size": st.st_size,
                          "mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "dev": st.st_dev, "nlink": 1,
                          "status": "ok", "action": action, "reason": reason, "finding": finding,
                          "target_relpath": (layout.block_relpath(tgt["base_name"], 0, hex_hash, 0)
                                             if target and tgt else None)})
        return rel

    def manifest(self, path) -> str:
        meta = {"root": str(self.root), "target_profile": "vllm-0.28", "namespaces": self.namespaces}
        cols = {k: [r[k] for r in self.rows] for k in self.rows[0]}
        with ManifestWriter(path, meta) as w:
            w.write_columns(cols)
        return str(path)


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    return Tree(root)


def test_sources_merge_in_base_name_order_and_duplicates_are_counted_once(tree, tmp_path):
    b2 = tree.namespace("org/m", 2, family="llmd")
    b4 = tree.namespace("org/m", 4, family="llmd")
    first, second = sorted([b2, b4])
    tree.namespaces[b2]["ranks"] = tree.namespaces[b4]["ranks"] = [0]  # single-rank rows for this test
    tree.namespaces[b2]["config_json"]["tp_size"] = tree.namespaces[b4]["config_json"]["tp_size"] = 1
    tree.block(second, "aa" * 32, b"\1" * 4096, action="link")
    tree.block(first, "aa" * 32, b"\1" * 4096, action="link")
    tree.block(first, "bb" * 32, b"\2" * 100, action="copy_pad")
    plan = build_plan(tree.manifest(tmp_path / "m.parquet"))
    (tp,) = plan.targets
    assert tp.sources == sorted([b2, b4])
    assert [a.source_base for a in tp.actions] == [first, first, second]
    counts = tp.counts()
    assert counts["link"] == {"blocks": 1, "bytes": 4096}
    assert counts["copy_pad"] == {"blocks": 1, "bytes": 4096}  # output bytes: padded
    assert counts["merge_duplicate"]["blocks"] == 1
    assert plan.pending == 2 and plan.dry_run_exit_code() == 1
    text = render_text(plan, "kvmigrate migrate --apply")
    assert "merge (already present: the same block from another source): 1 block (" in text
    assert "of which 1 only by size" in text  # no content hashes: compared at apply
    assert "to apply: kvmigrate migrate --apply" in text


def _two_sources(tree) -> tuple[str, str]:
    """Two single-rank namespaces of one model that map to one target (merge order a, b)."""
    b2 = tree.namespace("org/m", 2, family="llmd")
    b4 = tree.namespace("org/m", 4, family="llmd")
    tree.namespaces[b2]["ranks"] = tree.namespaces[b4]["ranks"] = [0]
    tree.namespaces[b2]["config_json"]["tp_size"] = tree.namespaces[b4]["config_json"]["tp_size"] = 1
    return tuple(sorted([b2, b4]))


def _hashed_block(tree, base: str, hex_hash: str, data: bytes) -> None:
    tree.block(base, hex_hash, data, action="link")
    tree.rows[-1]["content_xxh3_128"] = xxhash.xxh3_128_digest(data)


def test_competing_sources_with_hashes_merge_equal_bytes_and_place_neither_of_two_contents(tree, tmp_path):
    a, b = _two_sources(tree)
    _hashed_block(tree, b, "aa" * 32, b"\1" * 4096)  # equal bytes in both: one placed, one merge
    _hashed_block(tree, a, "aa" * 32, b"\1" * 4096)
    _hashed_block(tree, a, "bb" * 32, b"\2" * 4096)  # the target's size in both, other content: neither
    _hashed_block(tree, b, "bb" * 32, b"\3" * 4096)
    _hashed_block(tree, a, "cc" * 32, b"\4" * 4096)  # one source only
    plan = build_plan(tree.manifest(tmp_path / "m.parquet"))
    (tp,) = plan.targets
    assert tp.unverified_merges == 0  # the hashes prove the merge
    assert dict(tp.conflicts) == {f"competing source {a}: 4096 bytes, other content than {b}; none placed": 1,
                                  f"competing source {b}: 4096 bytes, other content than {a}; none placed": 1}
    assert [(x.source_base, x.target_relpath.rsplit("/", 1)[1][:2]) for x in tp.actions] == [
        (a, "aa"), (a, "cc"), (b, "aa")]  # the merge last: compared with the block placed before it
    expected = {"created": 2, "already_present": 1, "conflict": 2, "changed_since_scan": 0,
                "skipped_needs_transform": 0, "failed": 0}
    assert plan.outcomes() == expected and plan.dry_run_exit_code() == 5
    result = apply_plan(plan, command="test")
    assert dict(result.outcomes) == expected
    assert not (tree.root / tp.rank_dir / "bbb").exists()


def test_a_merge_of_equal_sizes_without_hashes_is_compared_at_apply(tree, tmp_path):
    a, b = _two_sources(tree)
    tree.block(a, "aa" * 32, b"\1" * 4096, action="link")
    tree.block(b, "aa" * 32, b"\2" * 4096, action="link")  # other bytes the manifest cannot see
    tree.block(a, "cc" * 32, b"\3" * 4096, action="link")
    tree.block(a, "dd" * 32, b"\4" * 8192, action="link")  # not the modal size, but the only one here
    tree.block(b, "dd" * 32, b"\4" * 8192, action="link")
    plan = build_plan(tree.manifest(tmp_path / "m.parquet"))
    (tp,) = plan.targets
    assert tp.unverified_merges == 2 and not tp.conflicts
    assert (plan.outcomes()["created"], plan.outcomes()["already_present"]) == (3, 2)
    assert "of which 2 only by size" in render_text(plan)
    result = apply_plan(plan, command="test")
    # a's blocks placed; b's compared: "aa" differs (a conflict), "dd" is the same
    assert [result.outcomes[k] for k in ("created", "already_present", "conflict")] == [3, 1, 1]
    assert (tree.root / tp.actions[0].target_relpath).read_bytes() == b"\1" * 4096


def test_not_reusable_and_skipped_blocks_are_counted_by_reason(tree, tmp_path):
    base = tree.namespace("org/m", 1)
    tree.block(base, "aa" * 32, b"x" * 4096, action="none", reason="short", target=False)
    tree.block(base, "bb" * 32, b"x" * 4096, action="none", reason="short", target=False)
    tree.block(base, "cc" * 32, b"x" * 8192, action="needs_relayout", reason="needs_relayout: 8192 bytes, B=4, "
               "T unknown")
    tree.block(base, "dd" * 32, b"x" * 4096, action="none", rank=1, reason="replica of rank 0", target=False,
               finding=findings.REPLICA_OF_PRIMARY)
    plan = build_plan(tree.manifest(tmp_path / "m.parquet"))
    (tp,) = plan.targets
    assert dict(tp.not_reusable) == {"short": 2}
    assert dict(tp.skipped) == {("needs_relayout", "needs_relayout: 8192 bytes, B=4, T unknown"): 1}
    assert plan.pending == 0 and plan.dry_run_exit_code() == 0
    result = apply_plan(plan, command="test")
    assert result.outcomes["skipped_needs_transform"] == 1 and result.outcomes["created"] == 0


def test_already_present_under_root_is_not_claimed_for_another_destination(tree, tmp_path):
    base = tree.namespace("org/m", 1)
    tree.block(base, "aa" * 32, b"x" * 4096, action="already_present")
    m = tree.manifest(tmp_path / "m.parquet")
    assert build_plan(m).targets[0].already_present == [1, 4096]
    (dest := tmp_path / "dest").mkdir()
    elsewhere = build_plan(m, dest=str(dest)).targets[0]
    assert elsewhere.already_present == [0, 0] and dict(elsewhere.not_reusable) == {ALREADY_AT_ROOT: 1}


def test_an_action_without_a_target_identity_is_refused(tree, tmp_path):
    base = tree.namespace("org/m", 1, target={})
    tree.namespaces[base]["target"] = None
    tree.block(base, "aa" * 32, b"x", action="link", target=False)
    tree.rows[-1]["target_relpath"] = "org_m_0123456789ab_r0/aaa/aa_g0/" + "aa" * 32 + ".bin"
    with pytest.raises(UsageError, match="has no target identity"):
        build_plan(tree.manifest(tmp_path / "m.parquet"))


def test_a_target_folder_that_is_not_the_digest_of_its_identity_is_refused(tree, tmp_path):
    target = _target("org/m")
    target["base_name"] = "org_m_0123456789ab"
    target["rank_dir"] = "org_m_0123456789ab_r0"
    base = tree.namespace("org/m", 1, target=target)
    tree.block(base, "aa" * 32, b"x" * 4096, action="link")
    with pytest.raises(UsageError, match="not the digest of its target identity"):
        build_plan(tree.manifest(tmp_path / "m.parquet"))


def test_a_source_outside_any_rank_folder_is_refused(tree, tmp_path):
    base = tree.namespace("org/m", 1)
    tree.block(base, "aa" * 32, b"x" * 4096, action="link")
    tree.rows[-1]["relpath"] = f"{base}/config.json"
    with pytest.raises(UsageError, match="not inside a rank folder"):
        build_plan(tree.manifest(tmp_path / "m.parquet"))


def test_not_a_manifest_is_a_usage_error(tmp_path):
    path = tmp_path / "plain.parquet"
    with ManifestWriter(path, {}) as w:
        w.write_columns({"relpath": ["x"]})
    with pytest.raises(UsageError, match="not a kvmigrate manifest"):
        build_plan(path)


def test_shell_form_writes_config_json_byte_exact(tree, tmp_path):
    model = "ørg/model 'quoted' \\ 100%"
    base = tree.namespace(model, 1, target=_target(model))
    tree.block(base, "aa" * 32, b"\3" * 100, action="copy_pad")
    dest = tmp_path / "dest"
    dest.mkdir()
    plan = build_plan(tree.manifest(tmp_path / "m.parquet"), dest=str(dest))
    script = "\n".join(render_commands(plan))
    proc = subprocess.run(["sh", "-c", script], capture_output=True)
    assert proc.returncode == 0, proc.stderr
    tp = plan.targets[0]
    assert (dest / tp.base_name / "config.json").read_bytes() == tp.config_bytes
    out = dest / tp.actions[0].target_relpath
    assert out.read_bytes() == b"\3" * 100 + b"\0" * 3996
    # noclobber: running it again changes nothing and does not fail
    proc = subprocess.run(["sh", "-c", script], capture_output=True)
    assert proc.returncode == 0 and out.read_bytes() == b"\3" * 100 + b"\0" * 3996
