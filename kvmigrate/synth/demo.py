"""The demo root: several families and eras of one fleet's caches, with a few defects."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvmigrate.errors import OperationalError, UsageError
from kvmigrate.synth.spec import SynthResult, SynthSpec
from kvmigrate.synth.tree import build
from kvmigrate.units import plural

MLA_MODEL = "deepseek-ai/DeepSeek-V2-Lite-Chat"
# LMCache tier folders (spec lmcache.md §1.1): what the deployments' configs named
LMC_FS_TIER = "lmcache-fs"        # remote_url: fs://…/lmcache-fs (FSConnector)
LMC_DISK_TIER = "lmcache-disk"    # local_disk: file:///…/lmcache-disk
LMC_GDS_TIER = "lmcache-gds"      # gds_path
LMC_CHUNK_TOKENS = 16             # the tiers' chunk_size (synth's block_tokens)
# What the tiers' writers had, and what the next reader runs (§3.3): the hash recipe (a
# fixed PYTHONHASHSEED, the builtin algorithm, one Python, one chunk size) and the release
# that wrote them. Without these every k3 name waits on a fact (needs_fact, §3.2 rule 4).
LMCACHE_FACTS = {
    tier: {"writer_release": "0.4.7", "pythonhashseed": "0", "hash_algorithm": "builtin",
           "python_version": "3.12", "target_python_version": "3.12",
           "chunk_size": LMC_CHUNK_TOKENS, "target_chunk_size": LMC_CHUNK_TOKENS}
    for tier in (LMC_FS_TIER, LMC_DISK_TIER, LMC_GDS_TIER)
}
# Mooncake Store SSD-offload stores (spec mooncake.md §1.1): each a folder of the volume
MC_VLLM_STORE = "mooncake-vllm"      # one vLLM client's ssd_offload_path, bucket backend
MC_SGLANG_STORE = "mooncake-sglang"  # SGLang's ssd_offload_path: a rank_* client root per TP rank
# What the operator knows of the stores' clients (§3.2): the vLLM store's were Mooncake 0.3.11
# (raw keys; the next reader runs 0.3.14), and both stores' clients are stopped, the proof an
# apply needs before it writes a client root (§5.1).
MOONCAKE_FACTS = {
    MC_VLLM_STORE: {"writer_release": "0.3.11", "engine_stopped": True},
    MC_SGLANG_STORE: {"writer_release": "0.3.13.post1", "engine_stopped": True},
}


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
        *lmcache_specs(with_defects),
        *mooncake_specs(with_defects),
    ]


def lmcache_specs(with_defects: bool = True) -> list[SynthSpec]:
    """The LMCache tiers of the sample (spec lmcache.md): one deployment of the llm-d tree's
    MLA model at TP 2 without save_only_first_rank (one seed: the same chunk hashes in both
    of its tiers), keeping an fs tier with RemoteMetadata headers (worker 0
    writes every chunk, `@2@0@`) and a local_disk tier (a copy per rank, every one
    `index_lost`: the leak the report makes visible); and a GQA model's GDS tier (data files
    and their `.metadata` sidecars). Defects: a torn fs chunk (`short`), a GDS data file
    whose sidecar is gone (`orphan_data`)."""
    def defects(*names: str) -> tuple[str, ...]:
        return names if with_defects else ()

    mla: dict[str, Any] = dict(family="lmcache", lmc_era="lmc-k3", model_name=MLA_MODEL, tp=2, kv_kind="mla",
                               lmc_save_only_first_rank=False, layers=4, block_tokens=LMC_CHUNK_TOKENS, seed=1)
    return [
        SynthSpec(**mla, lmc_backend="fs", lmc_tier=LMC_FS_TIER, lmc_fs_header=True, blocks=4,
                  defects=defects("short")),
        SynthSpec(**mla, lmc_backend="local_disk", lmc_tier=LMC_DISK_TIER, blocks=2),
        SynthSpec(family="lmcache", lmc_era="lmc-k3", lmc_backend="gds", lmc_tier=LMC_GDS_TIER,
                  model_name="mistralai/Mistral-7B-Instruct-v0.3", tp=1, layers=2, block_tokens=LMC_CHUNK_TOKENS,
                  blocks=3, seed=6, defects=defects("orphan_data")),
    ]


def mooncake_specs(with_defects: bool = True) -> list[SynthSpec]:
    """The Mooncake stores of the sample (spec mooncake.md), each showing what an operator hits:
    a vLLM bucket store written by Mooncake ≤ 0.3.11 (raw keys, which a 0.3.14 client
    registers as tenant `default` and never reads: pending `rekey`), with a `.bucket` whose
    `.meta` is gone (`orphan_data`: the next client start deletes it) and a `.bucket` cut in
    its last record (`short`: `is_exist` says 1, every read fails); and an SGLang TP 2
    file-per-key store (scoped keys, read in place) holding junk at a KVEntry's path
    (`header_invalid`: the client does not start)."""
    def defects(*names: str) -> tuple[str, ...]:
        return names if with_defects else ()

    common: dict[str, Any] = dict(family="mooncake", tp=2, layers=4, block_tokens=LMC_CHUNK_TOKENS)
    return [
        SynthSpec(**common, mc_store=MC_VLLM_STORE, mc_engine="vllm", mc_backend="bucket", mc_scheme="mc-raw",
                  model_name="meta-llama/Llama-3.2-3B-Instruct", blocks=4, seed=7,
                  defects=defects("orphan_data", "short")),
        SynthSpec(**common, mc_store=MC_SGLANG_STORE, mc_engine="sglang", mc_backend="file_per_key",
                  mc_scheme="mc-scoped", model_name="Qwen/Qwen3-14B", blocks=2, seed=8,
                  defects=defects("header_invalid")),
    ]


def describe(results: list[SynthResult]) -> tuple[str, str, str]:
    """What the sample holds, as the demo's summary names it: the namespaces' writers (with
    their vLLM schemes), the LMCache tiers (folder, backend) and the Mooncake stores (folder,
    backend, engine, key scheme)."""
    labels = {"vllm": "vLLM", "llmd": "llm-d", "vllmcpp": "vllm.cpp", "sglang": "SGLang HiCache"}
    engines = {"vllm": "vLLM", "sglang": "SGLang"}
    writers: dict[str, list[str]] = {}
    tiers: list[str] = []
    stores: list[str] = []
    count = 0
    for ns in (ns for r in results for ns in r.namespaces):
        if ns["family"] == "lmcache":
            tiers.append(f"{ns['tier']} ({ns['backend']})")
            continue
        if ns["family"] == "mooncake":
            keys = "raw keys" if ns["scheme"] == "mc-raw" else "scoped keys"
            stores.append(f"{ns['store_relpath']} ({ns['backend']}, {engines[ns['engine']]} TP {ns['tp']}, {keys})")
            continue
        count += 1
        schemes = writers.setdefault(labels.get(ns["family"], ns["family"]), [])
        if ns["family"] == "vllm":
            schemes.append(ns["scheme"])
    names = ", ".join(w + (" " + "/".join(s) if s else "") for w, s in writers.items())
    return (f"{plural(count, 'sample namespace')} ({names})",
            f"{plural(len(tiers), 'LMCache tier')}: {', '.join(tiers)}",
            f"{plural(len(stores), 'Mooncake store')}: {', '.join(stores)}")


def mooncake_findings(manifest_path: str | Path) -> list[str]:
    """What a scan found in the sample's Mooncake stores, read back from its manifest (so the
    demo says what the scan says, whatever a later kvmigrate plans for them): per store its
    objects by action, then each pending action and each status other than `ok`, counted in
    objects or files, with the manifest's reason for its first row (what the next client
    start deletes or refuses, which keys no read serves)."""
    from kvmigrate import manifest

    rows = manifest.read_table(str(manifest_path), columns=["relpath", "family", "source_base", "status", "action",
                                                             "reason", "object_key"]).to_pylist()
    stores: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["family"] == "mooncake":
            # source_base is `mooncake:<store>` or a deployment `mooncake:<store>:<engine>:...`
            stores.setdefault(str(row["source_base"]).split(":")[1], []).append(row)
    lines = []
    for store, store_rows in sorted(stores.items()):
        objects = [r for r in store_rows if r["object_key"] is not None]
        actions: dict[str, int] = {}
        for r in objects:
            actions[r["action"]] = actions.get(r["action"], 0) + 1
        lines.append(f"{store}: {plural(len(objects), 'object')} ("
                     + ", ".join(f"{n} {a}" for a, n in sorted(actions.items())) + ")")
        pending: dict[tuple[str, str], list[dict[str, Any]]] = {}  # the work first, then the damage
        damaged: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in store_rows:
            what = "object" if r["object_key"] is not None else "file"
            if r["object_key"] is not None and r["action"] not in ("none", "already_present"):
                pending.setdefault((r["action"], what), []).append(r)
            if r["status"] != "ok":
                damaged.setdefault((r["status"], what), []).append(r)
        for (label, what), hits in [*pending.items(), *damaged.items()]:
            lines.append(f"  {label}: {plural(len(hits), what)} - {hits[0]['reason']}")
    return lines


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
