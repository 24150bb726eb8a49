"""Write a SynthSpec's namespaces, block files and defects under a root."""

from __future__ import annotations

import os
from pathlib import Path

from kvmigrate import layout
from kvmigrate.synth import lmcache, mooncake, pages, sglang
from kvmigrate.synth.defects import inject
from kvmigrate.synth.files import block_file_bytes, write_file
from kvmigrate.synth.identities import namespace_dict, plan_namespaces
from kvmigrate.synth.spec import SynthResult, SynthSpec, check_spec


def effective_spec(spec: SynthSpec) -> SynthSpec:
    """The `pp_stage` defect is an llm-d tree with two pipeline stages."""
    if "pp_stage" in spec.defects and spec.pp == 1:
        return spec.replace(pp=2)
    return spec


def build(root: str | Path, spec: SynthSpec) -> SynthResult:
    """Write the namespaces of `spec` under `root` (created if needed) and inject its
    defects. May be called several times on one root to put several namespaces in it."""
    spec = effective_spec(spec)
    check_spec(spec)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if spec.family == "lmcache":  # tier directories, the names are the keys
        result = SynthResult(root=root.resolve())
        lmcache.build(root, spec, result)
        return result
    if spec.family == "sglang":  # one flat directory, the names are the identity
        result = SynthResult(root=root.resolve())
        sglang.build(root, spec, result)
        return result
    if spec.family == "mooncake":  # a store of client roots, the objects are keyed
        result = SynthResult(root=root.resolve())
        mooncake.build(root, spec, result)
        return result
    namespaces = plan_namespaces(spec)
    for ns in namespaces:
        write_file(root / ns.base_name / layout.CONFIG_NAME, ns.config_bytes)
        for rank in ns.ranks:
            (root / ns.rank_dir(rank)).mkdir(exist_ok=True)

    made: set[str] = set()

    def put(relpath: str, data: bytes) -> None:
        """write_file without re-checking folders this build already made (hot path)."""
        path = os.path.join(root, relpath)
        parent = os.path.dirname(path)
        if parent not in made:
            os.makedirs(parent, exist_ok=True)
            made.add(parent)
        try:
            with open(path, "wb") as f:
                f.write(data)
        except OSError:
            write_file(Path(path), data)  # a rebuild over a defect (no permission, not a file)

    # llm-d MLA replicas are identical files (vLLM has one rank; vllm.cpp headers differ per rank)
    same_bytes_on_every_rank = {ns.base_name: ns.family == "llmd" and spec.kv_kind == "mla" for ns in namespaces}
    blocks = []
    for group in range(spec.groups):
        for index in range(spec.blocks):
            hex_hash = pages.block_hash_hex(spec.seed, index, spec.hash_len)
            files: dict[int, str | None] = {}
            for ns in namespaces:
                data = None
                for rank in ns.ranks:
                    if data is None or not same_bytes_on_every_rank[ns.base_name]:
                        data = block_file_bytes(spec, ns, hex_hash, group, rank)
                    relpath = layout.block_relpath(ns.base_name, rank, hex_hash, group)
                    put(relpath, data)
                    files[rank] = relpath
            blocks.append({"hex": hex_hash, "group": group, "index": index, "files": files, "defect": None})

    result = SynthResult(root=root.resolve(), namespaces=[namespace_dict(spec, ns) for ns in namespaces],
                         blocks=blocks)
    if spec.defects or spec.pp > 1:
        inject(root, spec, namespaces, result)
    return result
