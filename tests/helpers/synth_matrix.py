"""Every synth family and era with every defect the generator can inject into it: the
matrix the default-migration test (tests/migrate/test_reference_reader_default.py) and
scripts/manifest_equal.py both walk.

Each era names a synth spec and the facts an operator states for it (vllm.cpp needs
none); `cases()` gives (era, defect) for every defect that era's tree can carry (one
defect per tree, checked by building it: some geometry limits only show then).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from kvmigrate.synth import SynthSpec, build
from kvmigrate.synth.spec import BLOCK_DEFECTS, TREE_DEFECTS, check_spec

FULL = ["--kv-kind", "full", "--total-kv-heads", "8", "--model-dtype", "bfloat16", "--writer-tp", "1", "--writer-pp", "1"]
MLA = ["--kv-kind", "mla", "--model-dtype", "bfloat16"]
# family, era and geometry -> the facts the operator states (vllm.cpp needs none)
ERAS = {
    "vllm-S1-tp1-full": ({"family": "vllm", "scheme": "S1", "tp": 1}, FULL),
    "vllm-S2-tp2-full": ({"family": "vllm", "scheme": "S2", "tp": 2}, FULL),
    "vllm-S2-tp4-mla-slice": ({"family": "vllm", "scheme": "S2", "tp": 4, "kv_kind": "mla"}, MLA),
    # folders a vLLM 0.24-0.33 gate collapsed: 0.34 reads them under their writer's topology
    "vllm-S3-tp1-collapsed": ({"family": "vllm", "scheme": "S3", "tp": 1, "agnostic": True}, FULL),
    "vllm-S3-tp2-collapsed": ({"family": "vllm", "scheme": "S3", "tp": 2, "agnostic": True},
                              [*FULL[:6], "--writer-tp", "2", "--writer-pp", "1"]),
    "llmd-tp1-full": ({"family": "llmd", "tp": 1}, FULL),
    "llmd-tp2-mla": ({"family": "llmd", "tp": 2, "kv_kind": "mla"}, MLA),
    "vllmcpp-tp2-mla": ({"family": "vllmcpp", "tp": 2, "kv_kind": "mla"}, []),
    "vllmcpp-tp1-full": ({"family": "vllmcpp", "tp": 1}, []),
}
GEOMETRY = {"layers": 2, "page_bytes": 256, "blocks": 4}


def spec_of(era: str, defect: str | None) -> dict:
    """The synth spec (as keyword arguments) of one era's tree with one defect (or none)."""
    return {**GEOMETRY, **ERAS[era][0], "defects": (defect,) if defect else ()}


def cases() -> list[tuple[str, str]]:
    """(era, defect) for every defect synth can inject into that era's tree."""
    out = []
    for era in ERAS:
        for defect in (*BLOCK_DEFECTS, *TREE_DEFECTS):
            candidate = SynthSpec(**spec_of(era, defect))
            try:
                check_spec(candidate)
                with tempfile.TemporaryDirectory() as tmp:  # geometry limits only show when built
                    build(Path(tmp), candidate)
            except ValueError:
                continue
            out.append((era, defect))
    return out
