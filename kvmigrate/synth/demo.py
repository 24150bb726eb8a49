"""The demo root: several families and eras of one fleet's caches, with a few defects."""

from __future__ import annotations

from pathlib import Path

from kvmigrate.synth.spec import SynthResult, SynthSpec
from kvmigrate.synth.tree import build

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
    ]


def build_demo_root(root: str | Path, with_defects: bool = True) -> list[SynthResult]:
    """Build the demo namespaces under `root`; one SynthResult per namespace family/era."""
    return [build(root, spec) for spec in demo_specs(with_defects)]
