"""vllm.cpp (kvmigrate's port of vLLM a8f296083f, formats.md §2.1): every worker writes its
own namespace (the rank in the 28-key identity, so in its digest), each block file is a
128-byte header (magic, digest, payload size, key) + the payload; the identity names its
kv kind. The identity and header codec stay in `kvmigrate.formats.vllmcpp`: it is a byte
format the synth, the transforms and apply's writer share, with no family decisions in it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvmigrate import layout
from kvmigrate.classify import UNVERIFIED
from kvmigrate.families import Family, worker_ranks
from kvmigrate.formats import vllmcpp as codec
from kvmigrate.identity import canonical
from kvmigrate.identity.values import VLLMCPP_PROFILE
from kvmigrate.identity.vllm_target import RANK_PRIVATE_SHARD, Target, target_lacks

MARKERS = ("format_version", "hash_algo", "kv_cache_spec_kind")
KV_KINDS = {"mla": "mla", "full_attention": "full", "sliding_window": "sliding"}


class Vllmcpp(Family):
    name = "vllmcpp"
    title = "vllm.cpp"
    proof_priority = 1  # its 28 keys may include vLLM's: they decide first
    reads_s1 = False
    target_engine = "vllmcpp"
    rank_namespaces = True
    header_len = codec.HEADER_SIZE
    replica_hash = "payload"  # headers differ by design (the rank's digest)

    def proof(self, fields: Mapping[str, Any]) -> str | None:
        if all(k in fields for k in MARKERS):
            return "config.json has format_version, hash_algo and kv_cache_spec_kind (vllm.cpp identity)"
        return None

    def config_json_bytes(self, fields):
        return self.canonical_bytes(fields)

    def config_matches(self, data, fields):
        return data == self.config_json_bytes(fields)  # the engine compares the canonical bytes

    def config_notes(self, raw, fields):
        if raw != self.canonical_bytes(fields):
            return ["config.json is not byte-canonical (vllm.cpp compares it field by field)"]
        return []

    def scheme_of(self, fields):
        return "vllmcpp-v1"

    def source_problems(self, fields):
        return codec.validate_identity(fields)

    def unknown_keys(self, fields):
        return sorted(k for k in fields if k not in codec.IDENTITY_KEYS and k not in codec.OPTIONAL_KEYS)

    def deployment(self, fields, source_base):
        return canonical.full_digest(dict(fields, rank=0), self.name)

    def target_profile(self, profile):
        return VLLMCPP_PROFILE

    def target(self, fields, facts, profile):
        return _target(fields)

    def target_digest(self, fields):
        if fields is None:
            return None
        return bytes.fromhex(canonical.full_digest(fields, self.name))

    def block_ranks(self, fields, present=(0,)):
        # every worker of the deployment (tp x pp x pcp) has its own namespace
        return worker_ranks(fields, ("tp_size", "pcp_size", "pp_size"), present)

    def kv_kind(self, fields, facts):
        if fields:
            return KV_KINDS.get(fields.get("kv_cache_spec_kind"), "hybrid")
        return facts.get("kv_kind")

    def blocks_per_file(self, fields):
        return fields.get("gpu_blocks_per_file", fields.get("blocks_per_file", 1))

    def payload_bytes(self, fields):
        return fields.get("page_size_bytes")

    def block_bytes(self, fields):
        payload = self.payload_bytes(fields)
        return codec.HEADER_SIZE + payload if isinstance(payload, int) and payload > 0 else None

    def size_status(self, plan, group, size):
        if size < codec.HEADER_SIZE:
            return "short", f"{size} bytes, shorter than the {codec.HEADER_SIZE}-byte header"
        if plan.payload_bytes is not None and size != codec.HEADER_SIZE + plan.payload_bytes:
            return "size_mismatch", (f"size {size}, expected {codec.HEADER_SIZE} + page_size_bytes "
                                     f"{plan.payload_bytes} = {codec.HEADER_SIZE + plan.payload_bytes}")
        return None

    def plan_action(self, plan, by_rank, group):
        t = plan.target
        first = by_rank[0]
        n = len(plan.expected_ranks)
        if n == 1:
            if t.rank_dir == plan.rank_dirs.get(first.rank):
                return "link", "single-rank vllm.cpp cache: already in place"
            return "rewrite_header", f"identity digest changes: new header for {t.base}"
        if plan.kv_kind == "mla":
            if not t.replicated_layout:
                return "none", "vllm.cpp MLA deployment is not collapsible under the target (replicated gate failed)"
            return "rewrite_header", (f"MLA payloads equal on all {n} ranks: rank 0's payload under the collapsed "
                                      f"replicated identity {t.base}; "
                                      + ("payload hashes verified equal" if plan.hashed else UNVERIFIED))
        return "none", "rank-private shard: each rank's payload is its own shard; no reader can use a collapsed copy"

    def header_check(self, header, *, digest, payload_size, hex_hash, group):
        return codec.verify_header(header, digest=digest, payload_size=payload_size,
                                   key=codec.make_key(bytes.fromhex(hex_hash), group))

    def verify_block(self, head, size, target, hex_hash, group):
        if not target.get("digest") or hex_hash is None:
            return None
        failed = codec.verify_header(head, digest=bytes.fromhex(target["digest"]),
                                     payload_size=int(target.get("payload_size") or size - codec.HEADER_SIZE),
                                     key=codec.make_key(bytes.fromhex(hex_hash), group))
        if failed:
            return "header_invalid", f"vllm.cpp would refuse and delete it: header check '{failed}' fails"
        return None


def _target(src: dict[str, Any]) -> Target:
    """vllm.cpp targets: identities are unchanged unless the replicated gate passes; then
    tp/pp/pcp/dcp = 1, rank 0 and `replicated_layout: true`. Payload equality across ranks
    is checked per block by the scanner."""
    reasons: list[str] = []
    if src.get("replicated_layout") is True:
        fields, agnostic, replicated = dict(src), True, True
    else:
        prefix = "not replicated"
        kind = src["kv_cache_spec_kind"]
        if kind != "mla":
            reasons.append(f"{prefix}: kv_cache_spec_kind is {kind} (needs mla)")
        if src["tp_size"] <= 1:
            reasons.append(f"{prefix}: tp is {src['tp_size']} (needs tp > 1; a single-rank identity is already "
                           "in place)")
        for key, label in (("pp_size", "pp"), ("pcp_size", "pcp"), ("dcp_size", "dcp")):
            if src[key] != 1:
                reasons.append(f"{prefix}: {label} is {src[key]} (needs 1)")
        replicated = agnostic = not reasons
        if replicated:  # unknown keys are never copied into a target
            fields = {k: v for k, v in src.items() if k in codec.IDENTITY_KEYS}
            fields.update(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0, replicated_layout=True)
        else:
            fields = dict(src)
    unreachable = None
    unknown = FAMILY.unknown_keys(src)
    if replicated and unknown and src.get("replicated_layout") is not True:
        unreachable = target_lacks(unknown[0])
    elif not replicated and src["tp_size"] * src["pp_size"] * src["pcp_size"] > 1:
        unreachable = RANK_PRIVATE_SHARD
    d12 = canonical.d12(fields, FAMILY.name)
    base = layout.base_name(fields["model_name"], d12)
    return Target(profile=VLLMCPP_PROFILE, family=FAMILY.name, fields=fields, d12=d12, base_name=base,
                  rank_dir=layout.rank_dir_name(base, fields["rank"]), parallel_agnostic=agnostic,
                  replicated_layout=replicated, reasons=reasons, assumed_facts={}, unreachable=unreachable)


FAMILY = Vllmcpp()
