"""Mooncake facts and target keys (spec mooncake.md §3.1-3.3, §2.1, §3.5): the FACTS.json
keys `"<store>:<model>"` > `"<store>"` > `"<model>"` > `"*"` (a model also by its HF id),
the flags filling gaps, bad values; the `fsdir` fact; each §3.3 row planned without a byte
rewrite (rekey by tenant, model, cache prefix; a stale `auto-` prefix or hash recipe;
another engine; MLA and GQA at another target TP; an SGLang suffix asking `kv_kind`);
registered keys (a raw `K` is `default\\0K`); a target key already held; and the
`kvmigrate facts` skeleton. On stores built by `kvmigrate synth --family mooncake`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmigrate import findings as fd
from kvmigrate import manifest
from kvmigrate.formats import mooncake as M
from kvmigrate.synth import SynthSpec, build
from kvmigrate.synth import mooncake as S

from helpers.cli_helpers import run, run_json

MC = dict(family="mooncake", layers=2, block_tokens=4, blocks=2)
HF = "meta-llama/Llama-3.1-8B-Instruct"  # synth's model
VLLM_MODEL = "Llama-3.1-8B-Instruct"
SGL_MODEL = "meta-llama-Llama-3.1-8B-Instruct"


def synth(root: Path, **kw):
    return build(root, SynthSpec(**{**MC, **kw}))


def scan(root: Path, out: Path, *flags: str) -> tuple[int, dict, list[dict]]:
    code, summary = run_json("scan", str(root), "-o", str(out), "--verify", "hash", *flags)
    return code, summary, manifest.read_table(out).to_pylist()


def objects(rows: list[dict]) -> list[dict]:
    """Object rows (index entries and KVEntries) of Mooncake deployments."""
    return [r for r in rows if r["family"] == "mooncake" and r["object_key"] is not None]


def facts_file(tmp_path: Path, obj: dict) -> str:
    p = tmp_path / "FACTS.json"
    p.write_text(json.dumps(obj))
    return str(p)


def deployment(summary: dict, engine: str = "") -> dict:
    return next(n for n in summary["namespaces"] if n["deployment"].count(":") >= 4
                and f":{engine}" in n["deployment"])


def tenant_of(key: bytes) -> str | None:
    return M.parse_storage_key(key).tenant


def add_pair(client: Path, entries: list[tuple[bytes, bytes]]) -> str:
    """A new live pair at the top of a client root, its id above every existing one (as
    Mooncake writes it: `.bucket`, then `.meta`); the `.meta` name."""
    ids = [i for p in client.iterdir() if (i := M.stoll_id(p.name)) is not None]
    ident = M.next_bucket_id(ids, S.EPOCH)
    data, meta = M.build_bucket(entries)
    (client / f"{ident}{M.BUCKET_SUFFIX}").write_bytes(data)
    (client / f"{ident}{M.META_SUFFIX}").write_bytes(M.encode_meta(meta))
    return f"{ident}{M.META_SUFFIX}"


def first_object(res, **kw) -> tuple[str, bytes]:
    """(engine key, value) of the first object synth wrote (built with `MC` and `kw`)."""
    spec = SynthSpec(**{**MC, **kw})
    b = res.blocks[0]
    o = b["objects"][0]
    return o["key"], S.rank_value(spec, b["hex"], o["rank"], o["pp"], o["half"] or "k")


# --- §3.2: where each fact comes from ----------------------------------------------------------

def test_each_fact_comes_from_the_most_specific_key_then_the_flags(tmp_path):
    """`"<store>:<model>"` > `"<store>"` > `"<model>"` > `"*"`, each fact on its own; a flag
    fills what no key sets; the source is recorded (facts:<key> or flag)."""
    root = tmp_path / "root"
    synth(root, tp=2)
    keys = {"store:" + VLLM_MODEL: {"target_tenant": "t1"}, "store": {"target_tenant": "t2", "fsdir": "fx"},
            VLLM_MODEL: {"target_tenant": "t3", "target_cache_prefix": "p3"}, "*": {"target_tenant": "t4"}}
    want = ["t1", "t2", "t3", "t4"]
    for i, key in enumerate(list(keys)):
        f = facts_file(tmp_path, {k: v for k, v in list(keys.items())[i:]})
        _, summary, rows = scan(root, tmp_path / f"m{i}.parquet", "--facts", f, "--target-cache-prefix", "flagged")
        ns = deployment(summary)
        assert ns["facts"]["target_tenant"] == want[i]
        assert ns["facts_source"]["target_tenant"] == f"facts:{key}"
        prefix = "p3" if i <= 2 else "flagged"  # the model key sets it, the flag fills it after
        assert ns["facts_source"]["target_cache_prefix"] == (f"facts:{VLLM_MODEL}" if i <= 2 else "flag")
        assert {tenant_of(r["target_key"]) for r in objects(rows)} == {want[i]}
        assert all(M.parse_vllm_key(M.parse_storage_key(r["target_key"]).engine).prefix == prefix
                   for r in objects(rows))


@pytest.mark.parametrize("engine,tagged", [("vllm", False), ("sglang", False), ("sglang", True)])
def test_an_hf_id_names_the_model_as_each_engine_spells_it(tmp_path, engine, tagged):
    """`org/name` is vLLM's `name` and SGLang's `org-name` or `<tag>_org-name` (§3.2); a
    target model keeps SGLang's extra_backend_tag (§3.1)."""
    root = tmp_path / "root"
    synth(root, mc_engine=engine, tp=2, model_name=("tag_" if tagged else "") + HF)
    f = facts_file(tmp_path, {"store:" + HF: {"target_model_name": "org/Other-7B"}})
    _, summary, rows = scan(root, tmp_path / "m.parquet", "--facts", f)
    ns = deployment(summary)
    assert ns["facts_source"]["target_model_name"] == f"facts:store:{HF}"
    want = "Other-7B" if engine == "vllm" else ("tag_" if tagged else "") + "org-Other-7B"
    for r in objects(rows):
        key = M.parse_storage_key(r["target_key"]).engine
        model = M.parse_vllm_key(key).model if engine == "vllm" else M.parse_sglang_key(key).prefix
        assert (model, r["action"]) == (want, "rekey")


@pytest.mark.parametrize("entry,flag", [({"kv_layout": "banana"}, None), ({"target_engine": "vllm-0.9"}, None),
                                        ({"target_tenant": ""}, None), ({"tp_lcm_size": 0}, None),
                                        ({"hash_recipe_changed": "yes"}, None), (None, ["--kv-layout", "nchw"]),
                                        (None, ["--target-engine", "trt"]), (None, ["--fsdir", "a/b"])])
def test_a_bad_value_is_a_usage_error_naming_the_key(tmp_path, entry, flag):
    root = tmp_path / "root"
    synth(root)
    args = ["--facts", facts_file(tmp_path, {"store": entry})] if entry else flag
    code, out = run("scan", root, "-o", tmp_path / "m.parquet", *args)
    assert code == 2
    assert (next(iter(entry)) if entry else flag[0]) in out
    assert ("must be" if entry else "Invalid value") in out  # (a value refused, not an unknown name)


def test_null_means_not_given(tmp_path):
    root = tmp_path / "root"
    synth(root)
    f = facts_file(tmp_path, {"store": {"target_tenant": None, "hash_recipe_changed": None}, "*": {"target_tenant": "x"}})
    _, summary, rows = scan(root, tmp_path / "m.parquet", "--facts", f)
    assert deployment(summary)["facts_source"]["target_tenant"] == "facts:*"
    assert {r["action"] for r in objects(rows)} == {"rekey"}


def test_the_fsdir_fact_finds_a_file_per_key_store(tmp_path):
    """MOONCAKE_OFFLOAD_FSDIR other than file_per_key_dir: without the fact the store's files
    are no cache; with it (flag or the store's key) its KVEntries are read in place."""
    root = tmp_path / "root"
    res = synth(root, mc_backend="file_per_key", mc_fsdir="kvdir", tp=2)
    n = sum(len(b["objects"]) for b in res.blocks)
    code, _ = run("scan", root, "-o", tmp_path / "m0.parquet")
    assert code & 8  # (nothing here but foreign files)
    for args in (["--fsdir", "kvdir"], ["--facts", facts_file(tmp_path, {"store": {"fsdir": "kvdir"}})]):
        _, _, rows = scan(root, tmp_path / "m.parquet", *args)
        got = objects(rows)
        assert len(got) == n and {r["action"] for r in got} == {"already_present"}
        assert all(r["target_relpath"] == "store/" + M.fpk(r["target_key"], "kvdir") for r in got)


# --- §3.3: the actions that need no byte rewrite ----------------------------------------------

@pytest.mark.parametrize("backend", ["bucket", "file_per_key"])
@pytest.mark.parametrize("scheme", M.SCHEMES)
def test_another_target_tenant_rekeys_every_object(tmp_path, backend, scheme):
    """Only the tenant differs (or the scoping too): `rekey` to `<target_tenant>\\0<key>`; a
    bucket entry in place (its client root), a KVEntry at fpk of its new key."""
    root = tmp_path / "root"
    synth(root, mc_backend=backend, mc_scheme=scheme, tp=2)
    code, summary, rows = scan(root, tmp_path / "m.parquet", "--target-tenant", "prod")
    for r in objects(rows):
        engine_key = M.parse_storage_key(r["object_key"]).engine
        assert r["action"] == "rekey" and r["target_key"] == M.scoped(engine_key, "prod")
        assert r["target_relpath"] == ("store/" if backend == "bucket" else "store/" + M.fpk(r["target_key"]))
    assert code & 1 and summary


def test_the_writers_tenant_is_the_default_and_a_raw_keys_is_default(tmp_path):
    root = tmp_path / "a"
    synth(root, mc_tenant="team", tp=2)
    _, summary, rows = scan(root, tmp_path / "m.parquet")
    assert {(r["action"], tenant_of(r["target_key"])) for r in objects(rows)} == {("already_present", "team")}
    assert any("tenant team (--target-tenant)" in n for n in deployment(summary)["notes"])
    root = tmp_path / "b"
    synth(root, mc_scheme="mc-raw", tp=2)
    _, _, rows = scan(root, tmp_path / "m2.parquet")
    assert {(r["action"], tenant_of(r["target_key"])) for r in objects(rows)} == {("rekey", "default")}


@pytest.mark.parametrize("writer,target,want", [("ops1", "ops2", "ops2"), ("ops1", "", None), ("", "ops2", "ops2")])
def test_an_operator_cache_prefix_is_rekeyed(tmp_path, writer, target, want):
    root = tmp_path / "root"
    synth(root, mc_cache_prefix=writer, tp=2)
    _, _, rows = scan(root, tmp_path / "m.parquet", "--target-cache-prefix", target)
    for r in objects(rows):
        v = M.parse_vllm_key(M.parse_storage_key(r["target_key"]).engine)
        assert (r["action"], v.prefix, v.model) == ("rekey", want, VLLM_MODEL)


def test_an_auto_prefix_other_than_the_targets_is_stale(tmp_path):
    """vLLM's `auto-` prefix hashes the build: another target prefix is `stale_hash_recipe`,
    action none, never renamed; the same one (or none stated) is read in place."""
    root = tmp_path / "root"
    synth(root, mc_cache_prefix="auto", tp=2)
    code, summary, rows = scan(root, tmp_path / "m.parquet")
    assert {r["action"] for r in objects(rows)} == {"already_present"} and code == 0
    assert any("auto- prefix" in n for n in deployment(summary)["notes"])
    for prefix in ("auto-0123456789abcdef", "ops", ""):
        code, _, rows = scan(root, tmp_path / "m.parquet", "--target-cache-prefix", prefix)
        got = {(r["status"], r["action"], r["target_key"]) for r in objects(rows)}
        assert got == {("stale_hash_recipe", "none", None)} and code & 1


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_changed_hash_recipe_is_stale(tmp_path, engine):
    root = tmp_path / "root"
    synth(root, mc_engine=engine, mc_scheme="mc-raw", tp=2)
    _, _, rows = scan(root, tmp_path / "m.parquet", "--hash-recipe-changed")
    assert {(r["status"], r["action"]) for r in objects(rows)} == {("stale_hash_recipe", "none")}
    _, _, rows = scan(root, tmp_path / "m.parquet", "--no-hash-recipe-changed")
    assert {(r["status"], r["action"]) for r in objects(rows)} == {("ok", "rekey")}


@pytest.mark.parametrize("engine,other", [("vllm", "sglang-0.5.23"), ("sglang", "vllm-0.34")])
def test_another_target_engine_plans_nothing(tmp_path, engine, other):
    root = tmp_path / "root"
    synth(root, mc_engine=engine, mc_scheme="mc-raw", tp=2)
    _, _, rows = scan(root, tmp_path / "m.parquet", "--target-engine", other)
    got = objects(rows)
    assert {(r["status"], r["action"]) for r in got} == {("ok", "none")}
    assert all(f"target engine {other}" in r["reason"] for r in got)
    same = "vllm-0.34" if engine == "vllm" else "sglang-0.5.23"
    _, _, rows = scan(root, tmp_path / "m.parquet", "--target-engine", same)
    assert {r["action"] for r in objects(rows)} == {"rekey"}


@pytest.mark.parametrize("scheme", M.SCHEMES)
def test_mla_keys_are_the_same_at_any_target_tp(tmp_path, scheme):
    """MLA keys do not name the TP (vLLM `tp_rank:0`, SGLang `__k`): at another target TP
    already_present (or rekey); SGLang's `__k` proves MLA, vLLM's one key rank does not
    (GQA with one key rank reads other keys at another TP): `needs_fact` for its kv_kind."""
    root = tmp_path / "root"
    synth(root, mc_store="v", mc_scheme=scheme, kv_kind="mla", tp=2)
    synth(root, mc_store="s", mc_engine="sglang", mc_scheme=scheme, kv_kind="mla", tp=2)
    want = "already_present" if scheme == "mc-scoped" else "rekey"
    _, _, rows = scan(root, tmp_path / "m.parquet", "--target-tp", "8")
    by_store = {(r["relpath"].split("/")[0], r["action"], r["asks"]) for r in objects(rows)}
    assert by_store == {("s", want, None), ("v", "none", "--kv-kind")}
    f = facts_file(tmp_path, {"v": {"kv_kind": "mla"}})
    _, _, rows = scan(root, tmp_path / "m.parquet", "--target-tp", "8", "--facts", f)
    assert {r["action"] for r in objects(rows)} == {want}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_gqa_at_another_target_tp_needs_a_reshard(tmp_path, engine):
    """GQA/MHA, n_s != n_t: the block's primary row (lowest key rank; SGLang rank 0's `_k`)
    is `needs_reshard` asking the missing geometry, the others point at it; all stated:
    the block's primary row is a `reshard` writing every target object (§3.3, §3.4, §4's
    rank-row rule)."""
    root = tmp_path / "root"
    synth(root, mc_engine=engine, tp=2)
    _, summary, rows = scan(root, tmp_path / "m.parquet", "--target-tp", "4", "--total-kv-heads", "8")
    got = objects(rows)
    primary = [r for r in got if r["action"] == "needs_reshard"]
    assert len(primary) == 2  # one per block
    assert all(r["rank"] == 0 and r["finding"] == fd.NEEDS_FACT for r in primary)
    # target rank 0's key (the same name at any TP) in rank 0's client root
    assert all((r["target_key"], r["target_relpath"]) == (r["object_key"], r["relpath"].rsplit("/", 1)[0] + "/")
               for r in primary)
    assert all(set(fd.asked_flags(r["asks"])) == {"--head-dim", "--layers", "--page-tokens", "--dtype-bytes"}
               for r in primary)
    rest = [r for r in got if r["action"] != "needs_reshard"]
    assert rest and all((r["action"], r["finding"], r["of_action"]) == ("none", fd.PART_OF_ACTION, "needs_reshard")
                        for r in rest)
    assert set(deployment(summary)["facts"]) >= {"total_kv_heads"}
    _, _, rows = scan(root, tmp_path / "m2.parquet", "--target-tp", "4", "--total-kv-heads", "8", "--head-dim", "4",
                      "--layers", "2", "--page-tokens", "4", "--dtype-bytes", "2")
    primary = [r for r in objects(rows) if r["action"] == "reshard"]
    assert len(primary) == 2 and all(r["finding"] == fd.TRANSFORM and r["output_bytes"] for r in primary)


def test_a_heads_outermost_layout_is_no_per_row_reshard(tmp_path):
    root = tmp_path / "root"
    synth(root, tp=2)
    _, _, rows = scan(root, tmp_path / "m.parquet", "--target-tp", "4", "--total-kv-heads", "8", "--kv-layout", "hnd")
    primary = [r for r in objects(rows) if r["action"] == "needs_reshard"]
    assert primary and all("hnd" in r["reason"] for r in primary)


def test_vllm_gqa_key_ranks_stop_at_the_heads(tmp_path):
    """vLLM GQA key ranks are min(tp, H): TP 8 and TP 16 of 8 heads read the same keys; the
    heads not stated, the row asks for them."""
    root = tmp_path / "root"
    synth(root, tp=8)
    _, _, rows = scan(root, tmp_path / "m.parquet", "--target-tp", "16", "--total-kv-heads", "8")
    assert {r["action"] for r in objects(rows)} == {"already_present"}
    _, _, rows = scan(root, tmp_path / "m.parquet", "--target-tp", "16")
    got = objects(rows)
    assert {(r["action"], r["finding"], r["asks"]) for r in got} == {("none", fd.NEEDS_FACT, "--total-kv-heads")}


def test_an_sglang_one_number_suffix_asks_kv_kind(tmp_path):
    """SGLang MLA at pp 2 writes `_<pp>_k` only: MHA TP ranks or MLA stages? `needs_fact`
    asking --kv-kind; `mla` stated: read in place."""
    root = tmp_path / "root"
    synth(root, mc_engine="sglang", kv_kind="mla", tp=2, pp=2)
    _, summary, rows = scan(root, tmp_path / "m.parquet")
    got = objects(rows)
    assert {(r["status"], r["action"], r["finding"], r["asks"]) for r in got} == \
        {("ok", "none", fd.NEEDS_FACT, "--kv-kind")}
    _, _, rows = scan(root, tmp_path / "m.parquet", "--kv-kind", "mla")
    assert {(r["status"], r["action"]) for r in objects(rows)} == {("ok", "already_present")}


# --- §2.1, §3.5: registered keys and keys already held ----------------------------------------

@pytest.mark.parametrize("same", [True, False])
def test_a_raw_and_a_scoped_entry_register_one_key(tmp_path, same):
    """A raw `K` registers as `default\\0K` under >= 0.3.12: with a live `default\\0K` entry
    the key is in two live entries, every read fails; other values: `replica_mismatch`."""
    root = tmp_path / "root"
    res = synth(root, mc_scheme="mc-raw", tp=2)
    key, value = first_object(res, mc_scheme="mc-raw", tp=2)
    meta = add_pair(root / "store", [(M.scoped(key), value if same else bytes(len(value) - 1) + b"\1")])
    _, _, rows = scan(root, tmp_path / "m.parquet")
    both = [r for r in objects(rows) if M.parse_storage_key(r["object_key"]).engine == key]
    assert len(both) == 2 and any(r["relpath"] == f"store/{meta}" for r in both)
    assert {r["status"] for r in both} == ({"ok"} if same else {"replica_mismatch"})
    assert all(r["action"] == "none" and "live entries" in r["reason"] for r in both)


def test_a_rekey_onto_a_key_held_with_the_same_value_is_present_there(tmp_path):
    """A raw KVEntry whose scoped key fpk(default\\0K) already holds with the same value:
    `already_present` at that entry (prune --migrated takes the raw one), never rewritten."""
    root = tmp_path / "root"
    res = synth(root, mc_backend="file_per_key", mc_scheme="mc-raw", tp=2)
    key, value = first_object(res, mc_backend="file_per_key", mc_scheme="mc-raw", tp=2)
    target = root / "store" / M.fpk(M.scoped(key))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(M.encode_kv_entry(M.KVEntry(M.scoped(key), value)))
    _, _, rows = scan(root, tmp_path / "m.parquet")
    src = next(r for r in objects(rows) if r["object_key"] == key.encode())
    assert (src["action"], src["target_relpath"], src["target_key"]) == \
        ("already_present", f"store/{M.fpk(M.scoped(key))}", M.scoped(key))
    others = [r for r in objects(rows) if r is not src and r["relpath"] != src["target_relpath"]]
    assert others and {r["action"] for r in others} == {"rekey"}


@pytest.mark.parametrize("backend", ["bucket", "file_per_key"])
def test_a_rekey_onto_a_key_held_with_other_bytes_is_target_occupied(tmp_path, backend):
    root = tmp_path / "root"
    res = synth(root, mc_backend=backend, tp=2)
    key, value = first_object(res, mc_backend=backend, tp=2)
    other = bytes(len(value))[:-1] + b"\7"
    if backend == "bucket":
        holder = "store/" + add_pair(root / "store", [(M.scoped(key, "prod"), other)])
    else:
        p = root / "store" / M.fpk(M.scoped(key, "prod"))
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(M.encode_kv_entry(M.KVEntry(M.scoped(key, "prod"), other)))
        holder = f"store/{M.fpk(M.scoped(key, 'prod'))}"
    _, _, rows = scan(root, tmp_path / "m.parquet", "--target-tenant", "prod")
    src = next(r for r in objects(rows) if r["object_key"] == M.scoped(key))
    assert (src["action"], src["finding"], src["aliases_relpath"], src["of_action"]) == \
        ("none", fd.TARGET_OCCUPIED, holder, "rekey")
    assert {r["action"] for r in objects(rows) if r["relpath"] != holder and r is not src} == {"rekey"}


@pytest.mark.parametrize("same", [True, False])
def test_two_sources_of_one_target_key_plan_only_the_first(tmp_path, same):
    """Tenants `a` and `b` hold one key; the target's tenant `c`: the first source (by
    relpath, index) is rekeyed, the other is already_present after it (same value) or
    target_occupied (other bytes): never two entries of one key."""
    root = tmp_path / "root"
    res = synth(root, mc_tenant="a", tp=2)
    key, value = first_object(res, mc_tenant="a", tp=2)
    meta = add_pair(root / "store", [(M.scoped(key, "b"), value if same else value[::-1])])
    _, _, rows = scan(root, tmp_path / "m.parquet", "--target-tenant", "c")
    both = sorted((r for r in objects(rows) if M.parse_storage_key(r["object_key"]).engine == key),
                  key=lambda r: (r["relpath"], r["object_index"]))
    assert [r["target_key"] for r in both] == [M.scoped(key, "c")] * 2 and both[1]["relpath"] == f"store/{meta}"
    assert both[0]["action"] == "rekey"
    if same:
        assert (both[1]["action"], both[1]["target_relpath"]) == ("already_present", "store/")
    else:
        assert (both[1]["action"], both[1]["finding"]) == ("none", fd.TARGET_OCCUPIED)


# --- `kvmigrate facts` --------------------------------------------------------------------------

def test_the_facts_skeleton_has_one_entry_per_deployment(tmp_path):
    """Keyed `"<store>:<model>"`: the facts its verdicts asked, `engine_stopped`,
    `writer_release`, and what is stated; every other family's entries as before."""
    root = tmp_path / "root"
    synth(root, mc_store="v", tp=2)
    synth(root, mc_store="s", mc_engine="sglang", kv_kind="mla", tp=2, pp=2)
    code, out = run("facts", root, "--target-tp", "4", "--target-tenant", "prod")
    assert code == 1  # (facts not stated)
    got = json.loads(out[: out.rindex("}") + 1])
    assert set(got) == {"v:" + VLLM_MODEL, "s:" + SGL_MODEL}
    assert got["v:" + VLLM_MODEL] == {"engine_stopped": None, "writer_release": None, "total_kv_heads": None,
                                      "target_tp": 4, "target_tenant": "prod"}
    assert got["s:" + SGL_MODEL] == {"engine_stopped": None, "writer_release": None, "kv_kind": None,
                                     "target_tp": 4, "target_tenant": "prod"}


def test_explain_shows_the_mooncake_facts_of_stores_only(tmp_path):
    """`explain` lists a store deployment's facts with their source; a vLLM namespace of the
    same root is not shown facts only Mooncake reads."""
    root = tmp_path / "root"
    build(root, SynthSpec(family="vllm", tp=2, blocks=2))
    synth(root, mc_store="mc", tp=2)
    m = tmp_path / "m.parquet"
    _, summary, _ = scan(root, m, "--target-tenant", "prod")
    by_ns = {}
    for ns in summary["namespaces"]:
        code, out = run_json("explain", m, ns["source_base"])
        assert code in (0, 1)
        by_ns[ns["deployment"] or ns["source_base"]] = {f["name"]: f for f in out["facts"]}
    mc = next(f for n, f in by_ns.items() if n.startswith("mooncake:mc:vllm"))
    assert mc["target_tenant"]["value"] == "prod" and mc["target_tenant"]["source"] == "flag --target-tenant"
    assert {"fsdir", "target_tp", "hash_recipe_changed"} <= set(mc)
    other = [f for n, f in by_ns.items() if not n.startswith("mooncake:")]
    assert other and all("fsdir" not in f and "target_tenant" not in f for f in other)


def test_a_link_onto_a_path_holding_another_file_is_target_occupied(tmp_path):
    """A misfiled KVEntry whose fpk(key) holds a file that is no KVEntry of it: never
    linked over (`target_occupied`, the path in `aliases_relpath`)."""
    root = tmp_path / "root"
    synth(root, mc_backend="file_per_key", tp=2)
    entry = next(p for p in sorted((root / "store" / M.DEFAULT_FSDIR).rglob("*")) if p.is_file())
    a, b = entry.parent.parent.name, entry.parent.name
    stray = entry.parent.parent.parent / ("a" if a != "a" else "b") / b / entry.name
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(entry.read_bytes())
    entry.write_bytes(b"not a KVEntry at all")
    _, _, rows = scan(root, tmp_path / "m.parquet")
    r = next(r for r in objects(rows) if r["relpath"] == str(stray.relative_to(root)))
    assert (r["status"], r["action"], r["finding"], r["aliases_relpath"], r["of_action"]) == \
        ("misfiled", "none", fd.TARGET_OCCUPIED, str(entry.relative_to(root)), "link")


def test_an_lcm_store_is_its_own_target_at_each_divisor(tmp_path):
    """SGLang with tp_lcm_size: key ranks are virtual, served to every TP dividing it; a
    target TP that does not divide it is a conversion, not planned (§2.3, §3.1)."""
    root = tmp_path / "root"
    synth(root, mc_engine="sglang", tp=4)
    _, _, rows = scan(root, tmp_path / "m.parquet", "--tp-lcm-size", "4", "--target-tp", "2")
    assert {r["action"] for r in objects(rows)} == {"already_present"}
    _, _, rows = scan(root, tmp_path / "m.parquet", "--tp-lcm-size", "4", "--target-tp", "8")
    got = objects(rows)
    assert {r["action"] for r in got} == {"none"} and all("tp_lcm_size 4" in r["reason"] for r in got)
