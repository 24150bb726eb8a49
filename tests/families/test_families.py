"""The family registry (kvmigrate.families): one module per writer family is the only place
that knows a family by its name (issue 17), and the one list every other list comes from."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import click
import pytest

import kvmigrate
from kvmigrate import classify, context, families
from kvmigrate.cli import cli
from kvmigrate.identity import canonical, facts, values
from kvmigrate.options import ScanOptions
from kvmigrate.synth import spec as synth_spec

from helpers.synth_matrix import ERAS

PACKAGE = Path(kvmigrate.__file__).parent
# the names a module would compare to branch on a family (writer families and the two readings)
FAMILY_WORDS = frozenset(families.NAMES) | {families.AMBIGUOUS, families.UNKNOWN}
# where family names may be spelled: the family modules themselves, and synth (it writes
# each family's bytes, as a test oracle independent of the code it checks)
OWNERS = ("families", "synth")


def _family_literals(node: ast.AST) -> list[str]:
    """The family names a comparison operand spells: a str constant, or a tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if node.value in FAMILY_WORDS else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [w for e in node.elts for w in _family_literals(e)]
    return []


def family_branches(path: Path) -> list[str]:
    """`line: source` of every comparison against a family name in one file: ==, !=, in,
    not in (with a tuple of names), and str.startswith(<name>)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_family_literals(o) for o in operands):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and any(_family_literals(a) for a in node.args)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_outside_the_families_compares_a_family_name():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.split("/")[0] in OWNERS:
            continue
        hits = family_branches(path)
        if hits:
            offenders[rel] = hits
    assert offenders == {}, "ask the family object (kvmigrate.families.get(name)) instead:\n" + json.dumps(
        offenders, indent=1)


def test_the_guard_sees_each_kind_of_branch(tmp_path):
    """The guard itself: each way of spelling a family branch is caught (a regression in
    the ast walk would let every module pass)."""
    src = tmp_path / "m.py"
    src.write_text('if fam == "vllmcpp": pass\nif "llmd" != x: pass\nif f in ("vllm", "ambiguous"): pass\n'
                   'if s.startswith("vllmcpp"): pass\nif f == "mla": pass\n')
    assert [h.split(":")[0] for h in family_branches(src)] == ["1", "2", "3", "4"]


def test_every_family_list_is_the_registry():
    """values.FAMILIES, FACTS.json's choices, the CLI's --family choices and synth's
    families are the registry's names, and each name has its module (LMCache's included:
    its tiers are scanned, docs/lmcache.md)."""
    assert values.FAMILIES == families.NAMES
    assert tuple(facts.CHOICES["family"]) == families.NAMES
    assert synth_spec.FAMILIES == families.NAMES
    choices = {}
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        for p in cli.get_command(ctx, name).params:
            if p.name == "family" and isinstance(p.type, click.Choice):
                choices[name] = tuple(p.type.choices)
    # synth also writes the families whose module is still to come (values.SYNTH_ONLY)
    synth_only = tuple(f for f in values.SYNTH_ONLY if f not in families.NAMES)
    assert choices.pop("synth") == values.SYNTH_FAMILIES == synth_spec.SYNTH_FAMILIES == families.NAMES + synth_only
    assert choices and set(choices.values()) == {families.NAMES}, choices
    for name in families.NAMES:
        fam = families.get(name)
        assert fam.name == name and (PACKAGE / "families" / f"{name}.py").is_file()
    # the synth matrix builds each tree family (a flat family's migrate is not in it yet: docs/sglang.md)
    assert {spec["family"] for spec, _ in ERAS.values()} == {f.name for f in families.writers()
                                                             if f.root_layout == "tree"}


def test_nothing_below_the_registry_imports_it():
    """The layering rule (docs/families.md): every module the registry and the family
    modules use (transitively) is a primitive below them, and none of those imports
    kvmigrate.families back (classify asks the context's family object, UnitPlan.fam)."""
    from tests.test_layering import _module_graph

    graph = _module_graph()
    ours = [m for m in graph if m == "kvmigrate.families" or m.startswith("kvmigrate.families.")]
    below, stack = set(), [d for m in ours for d in graph[m]]
    while stack:
        m = stack.pop()
        if m in below or m in ours:
            continue
        below.add(m)
        stack += graph.get(m, ())
    upward = sorted(f"{m} imports {d}" for m in below for d in graph.get(m, ()) if d in ours)
    assert below and upward == [], "\n".join(upward)


def test_a_pickled_family_is_the_registrys_object():
    """A classification context crossing a process boundary (scan workers) carries its
    family object: it unpickles to the registry's own object, not a copy."""
    import pickle

    for name in (*families.NAMES, families.AMBIGUOUS, "trtllm"):
        assert pickle.loads(pickle.dumps(families.get(name))) is families.get(name)
    ctx = classify.UnitPlan(fam=families.get("llmd"))
    assert pickle.loads(pickle.dumps(ctx)).fam is families.get("llmd")


def test_an_unlisted_name_reads_as_unknown_and_migrates_nothing():
    fam = families.get("trtllm")  # a writer with no module
    assert fam.name == "trtllm" and fam.transforms == ()
    with pytest.raises(ValueError, match="unknown family 'trtllm'"):
        canonical.d12({"model_name": "m"}, "trtllm")
    plan = classify.UnitPlan(fam=fam, target=classify.TargetInfo("p", "b", "d", "b_r0", False, False))
    rec = classify.FileRecord("b_r0/abc/0", 0, 0, "abc", 4096, 0, 0, 0, 1)
    assert classify.plan_action(plan, [rec], 0, "abc") == ("none", "unknown writer family 'trtllm'")
    assert context.block_ranks("trtllm", {"tp_size": 4}) == (0,)


@pytest.mark.parametrize("era", sorted(ERAS))
def test_family_hooks_agree_with_what_the_scan_proves(era, synth_root, tmp_path):
    """On every synth family and era: the family of each namespace gives the scheme,
    deployment, unknown keys and block ranks the scan recorded, each block path parses
    and re-forms by the family's path grammar, and a size the identity alone fixes is
    every block's size (the hooks scan.py, plan.py and apply.py are to ask in pass 2)."""
    from kvmigrate import manifest
    from kvmigrate.identity.facts import FactsResolver
    from kvmigrate.pipeline import scan

    from helpers.synth_matrix import spec_of

    root, _ = synth_root(spec_of(era, None))
    out = tmp_path / "m.parquet"
    scan(root, out, ScanOptions(facts_resolver=FactsResolver({}, None), threads=1))
    namespaces = manifest.read_metadata(out)["namespaces"]
    rows = manifest.read_table(out).to_pylist()
    assert namespaces and rows
    for base, ns in namespaces.items():
        fam, fields = families.get(ns["family"]), ns["config_json"]
        raw = (root / base / "config.json").read_bytes()
        assert fam.proof(fields) or fam.reads_s1
        assert fam.scheme_of(fields) == ns["scheme"]
        assert fam.deployment(fields, base) == ns["deployment"]
        assert fam.unknown_keys(fields) == ns["unknown_keys"]
        assert fam.config_notes(raw, fields) == [n for n in ns["notes"] if "canonical" in n]
        assert fam.config_matches(raw, fields)
        assert set(ns["ranks"]) <= set(fam.block_ranks(fields, ns["ranks"]))
        assert fam.claims_entry(base, True)
    blocks = [r for r in rows if r["block_hash"] is not None]
    assert blocks
    for r in blocks:
        fam = families.get(r["family"])
        folder, block = fam.parse_block_path(r["relpath"])
        assert (bytes.fromhex(block.hex_hash), block.group, folder.rank) == (r["block_hash"], r["group"], r["rank"])
        rank_dir = r["relpath"].split("/", 1)[0]
        assert fam.block_relpath(rank_dir, block.hex_hash, block.group) == r["relpath"]
        fields = namespaces[r["source_base"]]["config_json"]
        assert fam.block_bytes(fields) in (None, r["size"])
        assert (fam.block_bytes(fields) is not None) == (fam.header_len > 0)
