"""A writer process that behaves like a cache engine on a live root (reliability tests).

    python tests/helpers/engine_sim.py ROOT --spec '{"family": "llmd", "tp": 2, ...}' [--spec ...]
        --log LOG.jsonl [--seed N] [--duration S] [--evict-above N]

It plays, on the namespaces of the given SynthSpecs (already built under ROOT), what a
running engine and its clean-up tool do (reference/upstream-format.md §4,
llmd-format.md §4-5, vllmcpp-format.md §3):

* store a new block: vLLM / llm-d write `<final>_<digits>.tmp` (one suffix per writer
  thread) then `os.replace`; vllm.cpp writes `<final>.<pid>.<n>.tmp` then `rename`; a
  name that already exists is skipped; every rank's file of the block is written, rank 0
  first (MLA replicas hold the same bytes); no fsync, like the engines;
* now and then leave residue: a block whose files are short (a writer of another row
  size), logged `ok: false`, or a temp file that is never renamed (a crashed writer);
* load a block: read the row; a short read (vllm.cpp also: a header that does not
  verify) deletes the file, as the engines do;
* evict: above `--evict-above` block files, delete the least recently used (atime).

Every creation and deletion is a JSON line in LOG (flushed at once), so a checker knows
which files the simulator wrote correctly and what bytes they hold: `block_bytes()`
regenerates them. SIGTERM stops the loop after the current operation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from kvmigrate import layout
from kvmigrate.formats import vllmcpp
from kvmigrate.synth import SynthSpec
from kvmigrate.synth.files import block_file_bytes
from kvmigrate.synth.identities import Namespace, file_size, plan_namespaces

ENGINES = {"vllm": "vLLM fs tier", "llmd": "llm-d fs connector", "vllmcpp": "vllm.cpp"}


@dataclass
class Deployment:
    """One SynthSpec: the namespaces (rank folders) an engine of it writes together."""

    index: int
    spec: SynthSpec
    namespaces: list[Namespace]

    @property
    def family(self) -> str:
        return self.spec.family

    def files(self, hex_hash: str, group: int) -> list[tuple[str, Namespace, int]]:
        """(relpath, namespace, rank) of every file of one block, rank order."""
        out = [(layout.block_relpath(ns.base_name, rank, hex_hash, group), ns, rank)
               for ns in self.namespaces for rank in ns.ranks]
        return sorted(out, key=lambda t: t[2])

    def size(self, ns: Namespace) -> int:
        return file_size(self.spec, ns)


def deployments(specs: list[dict[str, Any]]) -> list[Deployment]:
    out = []
    for i, fields in enumerate(specs):
        spec = SynthSpec(**fields)
        out.append(Deployment(i, spec, plan_namespaces(spec)))
    return out


def block_bytes(spec_fields: dict[str, Any], base_name: str, hex_hash: str, group: int, rank: int,
                short: bool = False) -> bytes:
    """The bytes the simulator stores for a block file (checkers call this too)."""
    spec = SynthSpec(**spec_fields)
    ns = next(n for n in plan_namespaces(spec) if n.base_name == base_name)
    data = block_file_bytes(spec, ns, hex_hash, group, rank)
    return data[: len(data) // 2] if short else data


class Engine:
    def __init__(self, root: str, specs: list[dict[str, Any]], log_path: str, seed: int,
                 evict_above: int | None, residue_every: int = 12):
        self.root = root
        self.specs = specs
        self.deps = deployments(specs)
        self.rng = random.Random(seed)
        self.log = open(log_path, "a", buffering=1)  # noqa: SIM115  (closed by close())
        self.evict_above = evict_above
        self.residue_every = residue_every
        self.stop = False
        self.thread_suffix = self.rng.randrange(2 ** 63)  # vLLM / llm-d: one suffix per writer thread
        self.cpp_n = 0
        self.writes = 0
        # block files this engine knows about: relpath -> (deployment, namespace, rank, expected size)
        self.known: dict[str, tuple[Deployment, Namespace, int, int]] = {}
        for dep in self.deps:
            for ns in dep.namespaces:
                for rank in ns.ranks:
                    top = os.path.join(root, ns.rank_dir(rank))
                    for dirpath, _dirs, names in os.walk(top):
                        for name in names:
                            if name.endswith(".bin"):
                                rel = os.path.relpath(os.path.join(dirpath, name), root)
                                self.known[rel] = (dep, ns, rank, dep.size(ns))

    def record(self, **rec: Any) -> None:
        self.log.write(json.dumps({"t": time.time(), **rec}) + "\n")

    # --- store ---------------------------------------------------------------------

    def _tmp_name(self, final: str, family: str) -> str:
        if family == "vllmcpp":
            self.cpp_n += 1
            return f"{final}.{os.getpid()}.{self.cpp_n}.tmp"
        return f"{final}_{self.thread_suffix}.tmp"

    def store(self) -> None:
        dep = self.rng.choice(self.deps)
        hex_hash = f"{self.rng.getrandbits(dep.spec.hash_len * 4):0{dep.spec.hash_len}x}"
        group = self.rng.randrange(dep.spec.groups)
        self.writes += 1
        residue = self.writes % self.residue_every == 0
        abandon = self.writes % (self.residue_every * 2 + 1) == 0
        for rel, ns, rank in dep.files(hex_hash, group):
            final = os.path.join(self.root, rel)
            if os.path.exists(final):
                continue  # the engines skip a block that is already stored
            data = block_bytes(self.specs[dep.index], ns.base_name, hex_hash, group, rank, short=residue)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = self._tmp_name(final, dep.family)
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            if abandon:
                self.record(op="abandon_tmp", path=os.path.relpath(tmp, self.root))
                return  # a crashed writer: the temp file stays, the block never appears
            if dep.family == "vllmcpp":
                os.rename(tmp, final)
            else:
                os.replace(tmp, final)
            self.known[rel] = (dep, ns, rank, dep.size(ns))
            self.record(op="write", path=rel, deployment=dep.index, base=ns.base_name, hex=hex_hash,
                        group=group, rank=rank, size=len(data), ok=not residue)

    # --- load ----------------------------------------------------------------------

    def load(self) -> None:
        if not self.known:
            return
        rel = self.rng.choice(sorted(self.known))
        dep, ns, rank, size = self.known[rel]
        path = os.path.join(self.root, rel)
        try:
            with open(path, "rb") as f:  # a plain read: updates atime, as the engines do
                data = f.read(size)
        except FileNotFoundError:
            self.known.pop(rel, None)
            return
        bad = len(data) < size
        if not bad and dep.family == "vllmcpp":
            hex_hash = os.path.basename(rel)[:-4]
            group = int(rel.split("/")[-2].split("_g")[1])
            bad = vllmcpp.verify_header(data[: vllmcpp.HEADER_SIZE], digest=bytes.fromhex(ns.digest),
                                        payload_size=ns.fields["page_size_bytes"],
                                        key=vllmcpp.make_key(bytes.fromhex(hex_hash), group)) is not None
        if bad:
            self._delete(rel, "short read")

    # --- evict ---------------------------------------------------------------------

    def evict(self) -> None:
        if self.evict_above is None or len(self.known) <= self.evict_above:
            return
        ages = []
        for rel in self.known:
            try:
                ages.append((os.lstat(os.path.join(self.root, rel)).st_atime_ns, rel))
            except FileNotFoundError:
                pass
        if ages:
            self._delete(min(ages)[1], "evicted")

    def _delete(self, rel: str, why: str) -> None:
        try:
            os.unlink(os.path.join(self.root, rel))
        except FileNotFoundError:
            pass
        else:
            self.record(op="delete", path=rel, why=why)
        self.known.pop(rel, None)

    # --- loop ----------------------------------------------------------------------

    def run(self, duration: float, max_ops: int | None = None) -> int:
        end = time.monotonic() + duration
        ops = 0
        self.record(op="start", pid=os.getpid(), engines=[ENGINES[d.family] for d in self.deps])
        while not self.stop and time.monotonic() < end and (max_ops is None or ops < max_ops):
            roll = self.rng.random()
            if roll < 0.55:
                self.store()
            elif roll < 0.85:
                self.load()
            else:
                self.evict()
            ops += 1
            time.sleep(self.rng.uniform(0, 0.002))
        self.record(op="stop", ops=ops)
        self.log.close()
        return ops


def read_log(path: str) -> list[dict[str, Any]]:
    """The simulator's records (a torn last line is ignored)."""
    out = []
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):
                out.append(json.loads(line))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root")
    ap.add_argument("--spec", action="append", required=True, help="SynthSpec fields as JSON (repeatable)")
    ap.add_argument("--log", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--max-ops", type=int, default=None)
    ap.add_argument("--evict-above", type=int, default=None)
    args = ap.parse_args(argv)
    engine = Engine(args.root, [json.loads(s) for s in args.spec], args.log, args.seed, args.evict_above)

    def on_term(signum, frame):
        engine.stop = True

    signal.signal(signal.SIGTERM, on_term)
    engine.run(args.duration, args.max_ops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
