"""The demo root: several families and eras of one fleet's caches, with a few defects."""

from __future__ import annotations

import os
from pathlib import Path

from kvmigrate.errors import OperationalError, UsageError
from kvmigrate.synth.spec import SynthResult, SynthSpec
from kvmigrate.synth.tree import build
from kvmigrate.units import plural

MLA_MODEL = "deepseek-ai/DeepSeek-V2-Lite-Chat"


def demo_specs(with_defects: bool = True) -> list[SynthSpec]:
    """Small namespaces (tens of files in all) an operator might find on one cache volume.

    The llm-d TP=2 MLA tree and the vLLM S3 replicated tree hold the same model and seed,
    hence the same block keys and the same latent pages: migrating the llm-d tree lands
    blocks that are already present in the replicated namespace.
    """
    def defects(*names: str) -> tuple[str, ...]:
        return names if with_defects else ()

    return [
        SynthSpec(family="llmd", model_name=MLA_MODEL, tp=2, kv_kind="mla", layers=4, page_bytes=256, blocks=5,
                  seed=1, defects=defects("missing_rank", "tmp_vllm")),
        SynthSpec(family="vllm", scheme="S1", model_name="meta-llama/Llama-3.1-8B-Instruct", tp=1, layers=4,
                  page_bytes=256, blocks=5, seed=2, defects=defects("short", "foreign")),
        SynthSpec(family="vllm", scheme="S2", model_name="Qwen/Qwen2.5-7B-Instruct", tp=1, layers=4,
                  page_bytes=512, blocks=4, seed=3),
        SynthSpec(family="vllm", scheme="S3", model_name=MLA_MODEL, tp=2, kv_kind="mla", layers=4, page_bytes=256,
                  blocks=3, seed=1, replicated_layout=True),
        SynthSpec(family="vllmcpp", model_name="Qwen/Qwen3-4B", tp=1, layers=4, page_bytes=128, blocks=4, seed=4,
                  defects=defects("tmp_cpp_block")),
        # an SGLang 0.5.20 HiCache directory's pages at the top of the volume (TP=2): read in place by 0.5.23
        SynthSpec(family="sglang", sgl_era="e4", model_name="Qwen/Qwen3-8B", tp=2, layers=4, blocks=3, seed=5,
                  defects=defects("tmp_sglang")),
    ]


def require_empty_folder(path: str | Path) -> None:
    """Refuse a folder that holds anything: the sample must never mix with a real cache root
    (whose scan, journal and prune would then see the sample's files, and the reverse)."""
    try:
        entries = os.listdir(path)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise UsageError("not a folder", path=str(path), hint="pass an empty or new folder") from None
    except OSError as exc:
        raise OperationalError(f"cannot list the folder: {exc.strerror or exc}", path=str(path)) from None
    if entries:
        shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
        raise UsageError(f"the folder is not empty ({plural(len(entries), 'entry', 'entries')}: {shown}); the demo writes its "
                         f"sample, manifest, journal and report there", path=str(path),
                         hint="pass an empty or new folder (or no folder: a temp dir, removed at the end)")


def build_demo_root(root: str | Path, with_defects: bool = True) -> list[SynthResult]:
    """Build the demo namespaces under `root` (empty or new); one SynthResult per namespace family/era."""
    require_empty_folder(root)
    return [build(root, spec) for spec in demo_specs(with_defects)]
