"""`kvmigrate synth DIR`: write a synthetic, deterministic KV-cache tree."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from kvmigrate.cli.common import handle_errors, log_options, print_json
from kvmigrate.identity.values import SYNTH_FAMILIES
from kvmigrate.units import plural

if TYPE_CHECKING:  # the models are types only: importing them costs every command's start-up
    from kvmigrate.outputs import SynthOutput


def _defect_list(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...]:
    if not value:
        return ()
    return tuple(d.strip() for d in value.split(",") if d.strip())


@click.command("synth")
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False))
@click.option("--family", type=click.Choice(SYNTH_FAMILIES), default="vllm", show_default=True,
              help="Writer family: upstream vLLM fs tier, llm-d fs connector, vllm.cpp, SGLang HiCache file backend, "
                   "LMCache disk tier, Mooncake Store SSD offload store (--mc-*; not scanned yet).")
@click.option("--scheme", type=click.Choice(["S1", "S2", "S3"]), default="S1", show_default=True,
              help="vLLM identity era (llm-d is always S1; vllm.cpp ignores it).")
@click.option("--model", "model_name", default="meta-llama/Llama-3.1-8B-Instruct", show_default=True)
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True,
              help="llm-d: one base folder per pipeline stage.")
@click.option("--dcp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--kv-kind", type=click.Choice(["full", "mla"]), default="full", show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=4, show_default=True, help="Layers per KV cache group.")
@click.option("--tensors-per-layer", type=click.IntRange(min=1), default=2, show_default=True,
              help="Full attention: 2 for separate K and V tensors (MLA: always 1).")
@click.option("--blocks", type=click.IntRange(min=1), default=8, show_default=True,
              help="Block keys per rank folder and group.")
@click.option("--block-bytes", "page_bytes", type=click.IntRange(min=1), default=256, show_default=True,
              help="Bytes of one tensor's page for one GPU block on one rank.")
@click.option("--blocks-per-file", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--block-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--groups", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--hash-len", type=click.Choice(["64", "32"]), default="64", show_default=True,
              help="Hex chars of a block name (64: sha256 family, 32: xxhash family).")
@click.option("--dtype", default="auto", show_default=True,
              help="Cache dtype; S3 writes \"auto\" resolved to bfloat16.")
@click.option("--replicated", "replicated_layout", is_flag=True,
              help="vLLM S3 MLA tp>1: the replicated_layout namespace (rows hold one cell).")
@click.option("--agnostic", is_flag=True, help="vLLM: the collapsed parallel-agnostic namespace.")
@click.option("--canonical-format", default=None, help="vLLM S3: canonical rows, e.g. v1-nhd.")
@click.option("--sgl-era", type=click.Choice(["e1", "e2", "e3", "e4"]), default="e4", show_default=True,
              help="sglang: writer era (e1 0.4.9.post3, e2 0.4.9.post4-0.5.0rc2, e3 0.5.1.x, e4 0.5.2-0.5.23).")
@click.option("--sgl-layout", type=click.Choice(["layer_first", "page_first"]), default=None,
              help="sglang: --hicache-mem-layout of the writer (default: layer_first up to e3, page_first e4).")
@click.option("--cp", type=click.IntRange(min=1), default=1, show_default=True, help="sglang e4: attention-CP size.")
@click.option("--pools", default="", metavar="A,B", help="sglang e4: side pools (mamba, swa, indexer, draft, ...).")
@click.option("--lmc-backend", type=click.Choice(["local_disk", "fs", "gds", "mp"]), default="fs",
              show_default=True, help="lmcache: the backend that wrote the tier.")
@click.option("--lmc-era", type=click.Choice(["lmc-k1", "lmc-k2", "lmc-k3", "lmc-mp1"]), default="lmc-k3",
              show_default=True, help="lmcache: key era (k1 0.3.0-0.3.9, k2 0.3.9.post2-0.3.12, k3 0.3.13+, mp1 MP server).")
@click.option("--lmc-tier", default="cache", show_default=True,
              help="lmcache: tier folder under DIR ('.' makes DIR itself the tier).")
@click.option("--lmc-tags", default="", metavar="K%V,...", help="lmcache: lmcache.tag.* request tags of the keys.")
@click.option("--lmc-fs-header/--lmc-no-fs-header", default=True, show_default=True,
              help="lmcache fs: the RemoteMetadata header (save_chunk_meta).")
@click.option("--lmc-save-only-first-rank/--lmc-all-ranks", default=True, show_default=True,
              help="lmcache MLA: only rank 0 stores (ws collapses to 1), or every rank.")
@click.option("--lmc-gds-names", type=click.Choice(["auto", "quoted", "legacy"]), default="auto", show_default=True,
              help="lmcache gds: quoted names (0.4.3+) or the <= 0.4.2 '_' names (auto: quoted for lmc-k3).")
@click.option("--lmc-salt", default="", help="lmcache mp: a cache_salt ending the object keys.")
@click.option("--mc-backend", type=click.Choice(["bucket", "file_per_key"]), default="bucket", show_default=True,
              help="mooncake: bucket pairs (<id>.bucket + <id>.meta) or one KVEntry file per key.")
@click.option("--mc-engine", type=click.Choice(["vllm", "sglang"]), default="vllm", show_default=True,
              help="mooncake: the keys of vLLM 0.34 MooncakeStoreConnector or SGLang 0.5.23 HiCache (rank_* roots).")
@click.option("--mc-scheme", type=click.Choice(["mc-scoped", "mc-raw"]), default="mc-scoped", show_default=True,
              help="mooncake: <tenant>\\0<key> storage keys (0.3.12+) or raw engine keys (<= 0.3.11).")
@click.option("--mc-tenant", default="default", show_default=True, help="mooncake mc-scoped: the tenant.")
@click.option("--mc-store", default="store", show_default=True,
              help="mooncake: store folder under DIR ('.' makes DIR itself the store).")
@click.option("--mc-cache-prefix", default="", metavar="PREFIX",
              help="mooncake vllm: the keys' cache prefix (none by default; 'auto' draws an auto-<hex> one).")
@click.option("--mc-fsdir", default="file_per_key_dir", show_default=True,
              help="mooncake file_per_key: MOONCAKE_OFFLOAD_FSDIR.")
@click.option("--mc-bucket-keys", type=click.IntRange(min=1, max=500), default=500, show_default=True,
              help="mooncake bucket: keys per pair (also capped at 256 MiB).")
@click.option("--defects", callback=_defect_list, default=None, metavar="A,B,...",
              help="Defects to inject (see kvmigrate.synth.defects; lmcache and mooncake: their synth modules), "
                   "e.g. missing_rank,tmp_vllm.")
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same block keys and bytes.")
@click.option("--json", "as_json", is_flag=True, help="Print the SynthResult as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing (the tree is still built).")
@log_options
@handle_errors
def command(directory: str, as_json: bool, quiet: bool, hash_len: str, **options: object) -> None:
    """Generate a synthetic cache tree under DIR (for tests, the demo and benchmarks).

    Deterministic for a given seed. Run it several times on one DIR to put several
    namespaces side by side.
    """
    from kvmigrate.errors import UsageError
    from kvmigrate.synth import SynthSpec, build

    try:
        result = build(directory, SynthSpec(hash_len=int(hash_len), **options))  # type: ignore[arg-type]
    except ValueError as exc:
        raise UsageError(str(exc), path=directory) from None
    if as_json:
        out: SynthOutput = result.to_dict()
        print_json(out)
        return
    if quiet:
        return
    for ns in result.namespaces:
        if "tier_relpath" in ns:  # an LMCache tier directory: no base folder
            click.echo(f"{ns['tier_relpath']}  lmcache {ns['backend']} {ns['scheme']} tp={ns['tp']} ws={ns['ws']} "
                       f"{ns['kv_kind']} ranks={','.join(str(r) for r in ns['ranks'])} file={ns['file_size']}B")
            continue
        if "store_relpath" in ns:  # a Mooncake store: client roots of keyed objects
            click.echo(f"{ns['store_relpath']}  mooncake {ns['backend']} {ns['engine']} {ns['scheme']} tp={ns['tp']} "
                       f"pp={ns['pp']} {ns['kv_kind']} roots={len(ns['client_roots'])} objects={ns['objects']} "
                       f"object={ns['object_size']}B")
            continue
        if ns.get("base_name") is None:  # a flat directory (SGLang HiCache): no base folder
            click.echo(f"{result.root}  sglang {ns['scheme']} tp={ns['tp']} pp={ns['pp']} {ns['kv_kind']} "
                       f"{ns['layout']} file={ns['file_size']}B")
            continue
        ranks = ",".join(str(r) for r in ns["ranks"])
        click.echo(f"{ns['base_name']}  {ns['family']} {ns['scheme']} tp={ns['tp']} {ns['kv_kind']} "
                   f"ranks={ranks} file={ns['file_size']}B")
    objects = sum(ns["objects"] for ns in result.namespaces if "store_relpath" in ns)
    if objects:  # a Mooncake store counts objects (a bucket pair holds many)
        click.echo(f"{plural(objects, 'object')} under {result.root}")
    else:
        click.echo(f"{plural(len(result.block_files()), 'block file')} under {result.root}")
    for d in result.defects:
        click.echo(f"defect {d['name']}: {d['relpath']} -> {d['status']}")
