"""The operator's lifecycle as a model-based test: a `hypothesis` state machine whose rules
are the commands an operator runs on a small root of three families, an LMCache tier and a
Mooncake store written by Mooncake <= 0.3.11 (raw keys, rekeyed in place) (audit, `migrate
--apply` killed with SIGKILL at a random crash point, its rerun, a second run with
another journal, verify, rollback and its dry run, `prune --apply`, restore, purge, an
engine writing and evicting blocks, and the commands audit's hints print), checking after
every step:

* no source byte changed (except prune's renames into its quarantine, and a restore's back;
  a Mooncake `.meta` index is rewritten in place by design: instead every value the store
  held is read by a starting client, under its raw or its scoped key, to the writer's bytes);
* no command but `purge` deletes the last copy of any source block's bytes;
* a rollback removes only files its run created (never another run's, never a source);
* every dry run predicts its command: rollback's counts and exit code, prune's files;
* every command a hint prints (without placeholders) keeps these invariants when run as
  printed.

Used by tests/lifecycle/test_lifecycle_model.py (CI-sized, marked slow) and by
scripts/lifecycle_campaign.py (a longer run; its figures go in reports/RELIABILITY.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmigrate import layout
from kvmigrate.cli import cli
from kvmigrate.migrate import journal as jn
from kvmigrate.migrate.apply import CRASH_ENV
from kvmigrate.synth import SynthSpec, build

from helpers.reference_reader import _sha

KVMIGRATE = str(Path(sys.executable).with_name("kvmigrate"))
OWN = layout.OWN_DIR
SPECS = (
    dict(family="vllm", scheme="S2", tp=1, model_name="org/full-model", layers=2, page_bytes=256, blocks=8),
    dict(family="llmd", tp=2, kv_kind="mla", model_name="deepseek-ai/DeepSeek-V2-Lite-Chat", layers=2,
         page_bytes=256, blocks=8),
    dict(family="vllmcpp", tp=2, kv_kind="mla", model_name="org/cpp-model", layers=2, page_bytes=256, blocks=6),
    # an LMCache GDS tier written at TP 2, read next at TP 4: a reshard (data files and sidecars)
    dict(family="lmcache", lmc_backend="gds", lmc_tier="lmc", tp=2, model_name="org/lmc-model", layers=2,
         block_tokens=4, blocks=6),
    # Mooncake stores of raw keys (<= 0.3.11), read next by 0.3.14: a bucket store (its index rewritten
    # in place) and an SGLang file-per-key store (scoped KVEntries written; prune takes the raw ones)
    dict(family="mooncake", mc_store="mcs", mc_scheme="mc-raw", tp=2, model_name="org/mc-model", layers=2,
         block_tokens=4, blocks=6),
    dict(family="mooncake", mc_store="mcf", mc_backend="file_per_key", mc_engine="sglang", mc_scheme="mc-raw", tp=2,
         model_name="org/mc-model", layers=2, block_tokens=4, blocks=4),
)
STORES = ("mcs", "mcf")
FACTS = {"*": {"model_dtype": "bfloat16"},
         "org/full-model": {"kv_kind": "full", "total_kv_heads": 8, "writer_tp": 1, "writer_pp": 1},
         "deepseek-ai/DeepSeek-V2-Lite-Chat": {"kv_kind": "mla"},
         "lmc": {"writer_release": "0.5.6", "pythonhashseed": "0", "target_tp": 4, "total_kv_heads": 8,
                 "head_dim": 4, "layers": 2},
         **{store: {"engine_stopped": True} for store in STORES}}
CRASH_POINTS = ("intent", "created", "tmp_written", "linked")
STATS = {"steps": 0, "kills": 0, "invariant_checks": 0, "hints_run": 0}


def _store_paths(records: list[dict[str, Any]]) -> set[str]:
    """The paths a migration's Mooncake store records name as its own: KVEntries it placed
    (or intended), both files of each pair it wrote (or intended)."""
    out: set[str] = set()
    for r in records:
        if r.get("t") == "mc_entry":
            out.add(r["path"])
        elif r.get("t") == "mc_pair":
            out |= {f"{r['client']}/{r['id']}{suffix}" for suffix in (".bucket", ".meta")}
        elif r.get("t") == "mc_intent":
            out |= {o["path"] for o in r.get("outputs") or ()}
            out |= {f"{p['client']}/{p['id']}{suffix}" for p in r.get("pairs") or () for suffix in (".bucket", ".meta")}
            out |= {e["path"] for e in r.get("entries") or ()}
    return out


def files(root: Path) -> dict[str, tuple[int, str]]:
    """relpath -> (inode, sha256) of every regular file under root (kvmigrate's own included)."""
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p):
                out[os.path.relpath(p, root)] = (os.lstat(p).st_ino, _sha(p))
    return out


class Lifecycle(RuleBasedStateMachine):
    """One root per example; every command through the CLI (a kill through a subprocess)."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="kvmigrate-model-"))
        self.root = self.tmp / "root"
        self.facts = self.tmp / "FACTS.json"
        self.manifest = self.tmp / "m.parquet"
        self.violations: list[str] = []
        self.made: list[Path] = []

    def teardown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    # --- running commands -----------------------------------------------------------

    def cli(self, *args: Any) -> tuple[int, str]:
        res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
        STATS["steps"] += 1
        return res.exit_code, res.stdout + res.stderr

    def cli_json(self, *args: Any) -> tuple[int, dict]:
        res = CliRunner().invoke(cli, [str(a) for a in args] + ["--json"], catch_exceptions=False)
        STATS["steps"] += 1
        return res.exit_code, json.loads(res.stdout) if res.stdout.strip().startswith("{") else {}

    def killed(self, args: list[Any], crash: str) -> int:
        env = {**os.environ, CRASH_ENV: crash}
        p = subprocess.run([KVMIGRATE, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)
        STATS["steps"] += 1
        if p.returncode == -signal.SIGKILL:
            STATS["kills"] += 1
        return p.returncode

    def facts_args(self) -> list[Any]:
        return ["--facts", self.facts]

    def check(self, what: str, ok: bool, detail: str = "") -> None:
        STATS["invariant_checks"] += 1
        if not ok:
            self.violations.append(f"{what}: {detail}")
        assert ok, f"{what}: {detail}"

    # --- state ----------------------------------------------------------------------

    @initialize()
    def build_root(self) -> None:
        self.root.mkdir()
        self.store_objects: list[tuple[str, bytes, bytes]] = []  # (client root, raw key, value) of the stores
        for spec in SPECS:
            res = build(self.root, SynthSpec(**spec))
            if spec["family"] == "mooncake":
                from kvmigrate.synth import mooncake as mc

                self.store_objects += [(o["client_root"], o["key"].encode(), mc.rank_value(
                    SynthSpec(**spec), b["hex"], o["rank"], o["pp"], o["half"] or "k"))
                    for b in res.blocks for o in b["objects"]]
        self.facts.write_text(json.dumps(FACTS))
        self.sources = {rel: v for rel, v in files(self.root).items() if not rel.startswith(OWN)}
        self.source_hashes = {h for _, h in self.sources.values()}
        self.purged = False  # after a purge the last copy of a migrated block may be gone (by design)
        self.evicted: set[str] = set()  # hashes of target blocks the engine evicted
        self.before = files(self.root)

    def snapshot(self) -> None:
        self.before = files(self.root)

    # --- invariants -----------------------------------------------------------------

    @invariant()
    def sources_unchanged_and_last_copies_kept(self) -> None:
        if not hasattr(self, "sources"):
            return
        now = files(self.root)
        held = {h for _, h in now.values()}
        for rel, (_ino, h) in self.sources.items():
            if rel in now and not (rel.split("/", 1)[0] in STORES and rel.endswith(".meta")):
                self.check("source bytes unchanged", now[rel][1] == h, rel)
            elif not self.purged:
                # moved by prune into its quarantine (same inode), or held elsewhere
                self.check("no last copy deleted", h in held, f"{rel} is gone and its bytes are nowhere")
        if not self.purged and not self.evicted:
            missing = self.source_hashes - held
            self.check("every source block's bytes kept", not missing, f"{len(missing)} gone")

    @invariant()
    def every_store_value_reads(self) -> None:
        """Each value of the Mooncake store reads under its raw key (as written) or its scoped
        key (after a rekey), to the writer's bytes, at a client's start: never lost, never
        wrong, whatever step was killed."""
        if not getattr(self, "store_objects", None) or self.purged:
            return
        from kvmigrate.formats import mooncake as mfmt

        from helpers import mooncake_reader as reader

        starts: dict[str, Any] = {}
        for client, raw, value in self.store_objects:
            where = self.root / client
            if client not in starts:
                starts[client] = reader.start(where)
            got = {reader.read(where, starts[client], raw, scoped=False),
                   reader.read(where, starts[client], mfmt.scoped(raw.decode()))}
            self.check("every store value reads", value in got, f"{client}: {raw[-16:]!r}")

    # --- rules ----------------------------------------------------------------------

    @rule()
    def audit(self) -> None:
        code, out = self.cli_json("audit", self.root, *self.facts_args(), "--verify", "hash")
        self.check("audit exit code documented", code in range(0, 16), str(code))
        self.hints = [h["command"] for h in out.get("hints") or () if "<" not in h["command"]]

    @precondition(lambda self: getattr(self, "hints", None))
    @rule(k=st.integers(min_value=0, max_value=5))
    def run_a_printed_hint(self, k: int) -> None:
        command = self.hints[k % len(self.hints)]
        argv = shlex.split(command)
        if argv[:2] in (["kvmigrate", "facts"],) or "--apply" in argv and argv[1] == "prune" and "--purge" in argv:
            return
        self.snapshot()
        if argv[1] == "prune" and "--purge" in argv:
            self.purged = True
        STATS["hints_run"] += 1
        self.cli(*argv[1:])
        self.hints = []

    @rule(crash=st.one_of(st.none(), st.tuples(st.sampled_from(CRASH_POINTS), st.integers(1, 12))),
          via=st.sampled_from(["root", "manifest"]))
    def migrate_apply(self, crash, via: str) -> None:
        if via == "manifest":
            if self.cli("scan", self.root, "-o", self.manifest, "--verify", "hash", *self.facts_args())[0] & 2:
                return
            args = ["migrate", "--manifest", self.manifest, "--apply"]
        else:
            args = ["migrate", self.root, *self.facts_args(), "--apply"]
        self.journals()  # (the order the journals were made in)
        dcode, dry = self.cli_json(*args[:-1]) if crash is None and via == "manifest" else (None, {})
        self.snapshot()
        if crash is None:
            code, done = self.cli_json(*args)
            self.check("migrate exit code", code in (0, 1, 4, 5, 8, 9, 12, 13), str(code))
            if dry.get("outcomes") and done.get("outcomes") and not code & 8:
                # (the same manifest: nothing changed between the dry run and the apply). An apply that
                # resumes an interrupted run first finishes what that run had begun, which the dry run
                # (no journal read) counts as to be created: the two may only trade created for
                # already_present then, never change the total or any other outcome.
                want, got = dict(dry["outcomes"]), dict(done["outcomes"])
                if (done.get("apply") or {}).get("resumed"):
                    for d in (want, got):
                        d["created"] = d.get("created", 0) + d.pop("already_present", 0)
                self.check("migrate dry run predicts its outcomes", want == got,
                           f"{dry['outcomes']} vs {done['outcomes']}")
        else:
            self.killed(args, f"{crash[0]}:{crash[1]}")
        self.journals()

    def journals(self) -> list[Path]:
        """The root's migration journals in the order they were made (run ids of one second
        do not sort by time)."""
        jdir = Path(jn.default_journal_dir(str(self.root)))
        for p in sorted(jdir.glob("*.journal")) if jdir.is_dir() else []:
            if p not in self.made:
                self.made.append(p)
        return [p for p in self.made if p.exists()]

    def owned(self, journal: Path) -> tuple[dict[str, Any], dict[str, set], set[str]]:
        """(path -> inode of what `journal`'s runs created and still own, path -> inodes other
        journals' runs own, every path `journal` intended): a path may be made again by a
        later run once the engine evicted it or a rollback (of all, or of some targets)
        removed it."""
        runs = jn.load_runs(str(journal))
        own = {p: r.get("ino") for run in runs if not run.rolled_back for p, r in run.done.items()}
        for run in runs:  # a Mooncake store's files the run wrote (migrate/stores.py lists its records)
            if not run.rolled_back:
                own.update({p: self.before.get(p, (None,))[0] for p in _store_paths(run.store_records)})
        others: dict[str, set] = {}
        for other in self.journals():
            if other != journal:
                for run in jn.load_runs(str(other)):
                    if not run.rolled_back:
                        for p, r in run.done.items():
                            others.setdefault(p, set()).add(r.get("ino"))
        intended = {p for r in jn.read_records(str(journal)) if r.get("t") == "intent"
                    for item in r.get("items") or () for p in (item["path"], item.get("tmp")) if p}
        intended |= _store_paths(jn.read_records(str(journal)))
        return own, others, intended

    def judge_removals(self, journal: Path, own: dict, others: dict, intended: set) -> None:
        after = files(self.root)
        removed = {rel for rel in self.before if rel not in after and not rel.startswith(OWN)}
        restored = {rel for rel in after if rel not in self.before}
        for rel in removed - restored:
            if os.path.basename(rel) == layout.LOCK_NAME:
                continue  # kvmigrate's own lock file (an interrupted run's is removed with it)
            ino = self.before[rel][0]
            mine = own.get(rel) == ino or (rel in intended and ino not in others.get(rel, ()))
            self.check("rollback removes only its run's files", mine, rel)
            self.check("rollback never removes a source", rel not in self.sources, rel)

    @rule()
    def rollback_newest(self) -> None:
        journals = self.journals()
        if not journals:
            return
        journal = journals[-1]
        own, others, intended = self.owned(journal)
        dcode, dry = self.cli_json("rollback", journal, "--dry-run")
        self.snapshot()
        res = CliRunner().invoke(cli, ["rollback", str(journal), "--json"], catch_exceptions=False)
        STATS["steps"] += 1
        code, result = res.exit_code, json.loads(res.stdout) if res.stdout.strip().startswith("{") else {}
        if dcode != 2 and code != 2:
            self.check("rollback dry run predicts its exit code", dcode == code, f"{dcode} vs {code}")
            self.check("rollback dry run predicts its removals", dry.get("removed") == result.get("removed"),
                       f"{dry.get('removed')} vs {result.get('removed')}")
        self.judge_removals(journal, own, others, intended)
        # a refusal names the rollback of the targets that can still go: run it as printed
        hint = re.search(r"roll back the other targets with `([^`]+)`", res.stderr)
        self.rollback_hint = (journal, hint.group(1)) if hint else None

    @precondition(lambda self: getattr(self, "rollback_hint", None))
    @rule()
    def run_the_refused_rollbacks_hint(self) -> None:
        journal, command = self.rollback_hint
        self.rollback_hint = None
        own, others, intended = self.owned(journal)
        self.snapshot()
        STATS["hints_run"] += 1
        code, _ = self.cli(*shlex.split(command)[1:])
        self.check("the printed rollback runs", code in (0, 8), str(code))
        self.judge_removals(journal, own, others, intended)

    @rule()
    def run_the_rollback_list_script(self) -> None:
        """`rollback --dry-run --list` prints a script a person may run instead: run as
        printed, it keeps the invariants (it never deletes a last copy)."""
        journals = self.journals()
        if not journals:
            return
        res = CliRunner().invoke(cli, ["rollback", str(journals[-1]), "--dry-run", "--list"], catch_exceptions=False)
        STATS["steps"] += 1
        if res.exit_code != 0 or "rm -f" not in res.stdout:
            return
        self.snapshot()
        proc = subprocess.run(["sh", "-c", res.stdout], capture_output=True, text=True)
        STATS["steps"] += 1
        self.check("the --list script runs", proc.returncode == 0, proc.stderr[-500:])

    @rule()
    def prune_apply(self) -> None:
        dcode, dry = self.cli_json("prune", self.root, *self.facts_args(), "--quiet-period", "0")
        self.snapshot()
        code, done = self.cli_json("prune", self.root, *self.facts_args(), "--quiet-period", "0", "--apply")
        if dcode in (0, 1) and code == 0 and dry and done:
            self.check("prune dry run predicts its moves", dry.get("files") == sum((done.get("moved") or {}).values()),
                       f"{dry.get('files')} vs {done.get('moved')}")

    @rule()
    def restore_all(self) -> None:
        pdir = Path(jn.default_journal_dir(str(self.root))) / "prune"
        if pdir.is_dir() and any(pdir.glob("*.journal")):
            self.snapshot()
            code, _ = self.cli("restore", pdir)
            self.check("restore exit code", code in (0, 8), str(code))

    @rule()
    def purge(self) -> None:
        self.snapshot()
        code, _ = self.cli("prune", self.root, "--purge", "--older-than", "0s", "--apply")
        self.check("purge exit code", code in (0, 1, 8), str(code))
        self.purged = True

    @rule()
    def verify(self) -> None:
        jdir = Path(jn.default_journal_dir(str(self.root)))
        if jdir.is_dir() and any(jdir.glob("*.journal")):
            code, _ = self.cli("verify", self.root, "--journal", jdir)
            self.check("verify exit code", code in range(0, 16), str(code))

    @rule(k=st.integers(0, 1000), evict=st.booleans())
    def engine_writes_or_evicts(self, k: int, evict: bool) -> None:
        """The engine evicts a block of a target namespace, or writes a new one there."""
        targets = sorted(p for p in self.root.glob("*_r0") if p.is_dir() and not any(
            rel.startswith(p.name + "/") for rel in self.sources))
        if not targets:
            return
        rank_dir = targets[k % len(targets)]
        blocks = sorted(rank_dir.rglob("*.bin"))
        if evict and blocks:
            victim = blocks[k % len(blocks)]
            self.evicted.add(_sha(str(victim)))
            victim.unlink()
        elif not evict:
            name = hashlib.sha256(f"engine-{k}".encode()).hexdigest()
            block = rank_dir / name[:3] / f"{name[3:5]}_g0" / f"{name}.bin"
            block.parent.mkdir(parents=True, exist_ok=True)
            block.write_bytes(os.urandom(4096))
