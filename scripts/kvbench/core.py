"""The Bench: a run's settings, its kvmigrate, trees and timed groups."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .figures import FiguresMixin
from .groups import GroupsMixin
from .harness import BASE_TOOLS, DEFAULT_WORKDIR, GROUP_TOOLS, REPO, TOOLS, Group, capture, damon_pageout, q, rmtree
from .trees import TreeSpec, fs_free, space_needed, tree_specs, tree_summary, trees_of, walk_counts


class Bench(GroupsMixin, FiguresMixin):
    """A run's settings, its kvmigrate, trees and timed groups; the groups (GroupsMixin) and
    the figures (FiguresMixin) are in their own modules, the run itself in runner.py."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.scale = args.scale
        self.reps = args.reps
        self.workdir = Path(args.workdir or DEFAULT_WORKDIR / args.scale).resolve()
        self.out = self.workdir / "out"  # manifests and outputs (one per install in --before runs)
        self.out_dir = Path(args.out_dir).resolve()
        self.kvm = self._find_kvmigrate(args.kvmigrate)
        self.kvm_python = self._interpreter_of(self.kvm)
        self.specs = tree_specs(self.scale, getattr(args, "flat_files", None))
        self.groups_wanted = [g.strip() for g in args.only.split(",")] if args.only else \
            ["meta", "hash4k", "hash1m", "migrate", "startup"]
        self.trees: dict[str, dict] = {}
        self.groups: list[Group] = []
        self.startup: dict = {}
        self.profile: dict = {}
        self.notes: list[str] = []
        self.started = time.time()
        self.log_lines: list[str] = []

    # ---- plumbing

    def log(self, msg: str) -> None:
        line = f"[{time.time() - self.started:7.1f}s] {msg}"
        self.log_lines.append(line)
        print(line, flush=True)

    @staticmethod
    def _find_kvmigrate(given: str | None) -> str:
        if given:
            return str(Path(given).resolve())
        beside = Path(sys.executable).with_name("kvmigrate")
        for cand in (Path("/work/venv/bin/kvmigrate"), beside):
            if cand.exists():
                return str(cand)
        found = shutil.which("kvmigrate")
        if not found:
            sys.exit("bench: no `kvmigrate` executable found; pass --kvmigrate PATH "
                     "(e.g. /work/venv/bin/kvmigrate after `pip install -e .`)")
        return found

    @staticmethod
    def _interpreter_of(script: str) -> str:
        try:
            with open(script, "rb") as f:
                first = f.readline().decode()
        except OSError:
            return sys.executable
        if first.startswith("#!") and "python" in first:
            return first[2:].strip().split()[0]
        return sys.executable

    def kvm_has(self, command: str) -> tuple[bool, str]:
        p = subprocess.run([self.kvm, command, "--help"], capture_output=True, text=True)
        if p.returncode == 0:
            return True, ""
        msg = (p.stderr or p.stdout).strip().splitlines()
        return False, f"`kvmigrate {command}` is not available ({msg[-1] if msg else 'exit ' + str(p.returncode)})"

    def check_tools(self) -> None:
        """Exit naming the Debian packages to install when a wanted group's tool is missing."""
        needed = dict.fromkeys(BASE_TOOLS)
        for g in self.groups_wanted:
            needed.update(dict.fromkeys(GROUP_TOOLS.get(g, ())))
        missing = [t for t in needed if not shutil.which(t)]
        if not Path("/usr/bin/time").exists():
            self.notes.append("/usr/bin/time is not installed (not needed: RSS comes from os.wait4).")
        if missing:
            pkgs = sorted({TOOLS[t] for t in missing})
            sys.exit(f"bench: missing tools: {', '.join(missing)} (Debian packages {', '.join(pkgs)}).\n"
                     f"Install them with: apt-get update && apt-get install -y {' '.join(pkgs)}")

    # ---- space and trees

    def check_space(self) -> dict:
        self.workdir.mkdir(parents=True, exist_ok=True)
        need = space_needed(self.specs, self.groups_wanted)
        free = fs_free(self.workdir)
        reuse = {name: self._stamp_ok(spec) for name, spec in self.specs.items()}
        info = {"workdir": str(self.workdir), "needed_bytes_estimate": need["bytes"],
                "needed_inodes_estimate": need["inodes"], "free_bytes_before": free["bytes"],
                "free_inodes_before": free["inodes"], "fs_total_bytes": free["total_bytes"],
                "fs_total_inodes": free["total_inodes"], "trees_reused": reuse}
        self.log(f"workdir {self.workdir}: needs about {need['bytes'] / 2**30:.1f} GiB and "
                 f"{need['inodes']:,} inodes; free {free['bytes'] / 2**30:.1f} GiB and {free['inodes']:,} inodes")
        rebuilt = [name for name in trees_of(self.groups_wanted) if not reuse.get(name)]
        if rebuilt and (need["bytes"] > free["bytes"] or need["inodes"] > free["inodes"]):
            msg = (f"bench: not enough room in {self.workdir}: need ~{need['bytes'] / 2**30:.1f} GiB and "
                   f"{need['inodes']:,} inodes, have {free['bytes'] / 2**30:.1f} GiB and {free['inodes']:,}. "
                   "Use --workdir on a bigger filesystem or --scale small.")
            if not self.args.force:
                sys.exit(msg + " (--force to try anyway)")
            self.notes.append(msg + " Ran anyway (--force).")
        return info

    def tree_root(self, name: str) -> Path:
        return self.workdir / "trees" / name

    def _stamp_path(self, name: str) -> Path:
        return self.workdir / "trees" / f"{name}.stamp.json"

    def _stamp_ok(self, spec: TreeSpec) -> bool:
        try:
            stamp = json.loads(self._stamp_path(spec.name).read_text())
        except (OSError, ValueError):
            return False
        return stamp.get("spec") == spec.__dict__ and self.tree_root(spec.name).is_dir()

    def build_tree(self, spec: TreeSpec) -> dict:
        """Build with `kvmigrate synth` in --jobs processes, one seed each, into one root:
        the same namespace (same config.json), disjoint block keys."""
        root = self.tree_root(spec.name)
        stamp = self._stamp_path(spec.name)
        if self._stamp_ok(spec):
            info = json.loads(stamp.read_text())
            info["reused"] = True
            for name in sorted(set(os.listdir(root)) - set(info["top_level"])):
                self.log(f"tree {spec.name}: removing {name} left by an earlier run")
                rmtree(root / name)
            self.log(f"tree {spec.name}: reusing {root} ({info['counts']['files']:,} files)")
            return tree_summary(info)
        rmtree(root)
        stamp.unlink(missing_ok=True)
        root.mkdir(parents=True)
        jobs = max(1, min(self.args.jobs, spec.blocks))
        shares = [spec.blocks // jobs + (1 if i < spec.blocks % jobs else 0) for i in range(jobs)]
        self.log(f"tree {spec.name}: building {spec.files:,} files of {spec.file_bytes:,} B with "
                 f"{jobs} synth processes")
        start = time.perf_counter()
        procs = []
        logs = []
        for i, n in enumerate(shares):
            argv = [self.kvm, "synth", str(root), *spec.synth_args(n, seed=1 + i)]
            logf = self.workdir / f"synth-{spec.name}-{i}.log"
            logs.append(logf)
            with open(logf, "wb") as f:
                procs.append((argv, subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)))
        for argv, p in procs:
            if p.wait() != 0:
                sys.exit(f"bench: `{' '.join(argv)}` failed (exit {p.returncode}); see {logs[procs.index((argv, p))]}")
        seconds = time.perf_counter() - start
        counts = walk_counts(root)
        if counts["files"] != spec.files + spec.other_files:
            sys.exit(f"bench: {root} has {counts['files']} files, expected {spec.files + spec.other_files} "
                     "(block files + config.json, none in a flat directory)")
        info = {
            "spec": spec.__dict__, "root": str(root), "build_s": round(seconds, 2),
            "build_files_per_s": round(spec.files / seconds), "build_method": f"kvmigrate synth x{jobs} processes",
            "synth_commands": [" ".join(q(a) for a in argv) for argv, _ in procs],
            "counts": {k: v for k, v in counts.items() if k != "sample"}, "reused": False,
            "top_level": sorted(os.listdir(root)),
        }
        stamp.write_text(json.dumps(info, indent=1))
        self.log(f"tree {spec.name}: {counts['files']:,} files, {counts['dirs']:,} folders, "
                 f"{counts['bytes'] / 2**20:,.0f} MiB in {seconds:.1f} s")
        return tree_summary(info)

    # ---- the machine

    def machine(self) -> dict:
        cpu = "unknown"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        mem = {}
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                k, v = line.split(":", 1)
                if k in ("MemTotal", "MemAvailable"):
                    mem[k] = int(v.split()[0]) * 1024
        except OSError:
            pass
        fstype, mnt, dev, opts = "unknown", "", "", ""
        real = str(self.workdir)
        try:
            for line in Path("/proc/mounts").read_text().splitlines():
                d, m, t, o = line.split()[:4]
                if (real == m or real.startswith(m.rstrip("/") + "/")) and len(m) >= len(mnt):
                    fstype, mnt, dev, opts = t, m, d, o
        except OSError:
            pass
        pyver = capture([self.kvm_python, "-c", "import sys; print(sys.version.split()[0])"])
        libs = capture([self.kvm_python, "-c",
                        "import importlib.metadata as m\n"
                        "for p in ('kvmigrate','pyarrow','xxhash','click','tqdm'):\n"
                        "    print(p, m.version(p))"])
        debs = capture(["dpkg-query", "-W", "-f", "${Package} ${Version}\\n", *sorted(set(TOOLS.values()))])
        git_head = capture(["git", "-C", str(REPO), "log", "-1", "--format=%h %s"])
        dirty = capture(["git", "-C", str(REPO), "status", "--porcelain", "--", "kvmigrate"])
        return {
            "cpu_model": cpu, "cores": os.cpu_count(), "mem_total_bytes": mem.get("MemTotal"),
            "page_reclaim": damon_pageout(),
            "mem_available_bytes_at_start": mem.get("MemAvailable"), "kernel": platform.release(),
            "os": capture(["sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"]),
            "workdir_fs": fstype, "workdir_mount": mnt, "workdir_device": dev, "workdir_mount_options": opts,
            "python": pyver, "python_executable": self.kvm_python, "kvmigrate": self.kvm,
            "python_packages": dict(line.split(" ", 1) for line in libs.splitlines() if " " in line),
            "debian_packages": dict(line.split(" ", 1) for line in debs.splitlines() if " " in line),
            "git_head": git_head,
            "git_uncommitted_under_kvmigrate": [ln for ln in dirty.splitlines() if ln.strip()],
        }


    def leaf_walk(self) -> str:
        """Which leaf walk the measured kvmigrate's scan runs (README: Install)."""
        code = "import kvmigrate.scan as s; w = s.leaf_walk(); print(w.__file__ if w else '')"
        # cwd "/": `python -c` puts the working folder first on sys.path, and a checkout
        # there would be reported instead of what the measured install imports
        p = subprocess.run([self.kvm_python, "-c", code], capture_output=True, text=True, cwd="/")
        if p.returncode != 0:
            return "unknown"
        where = p.stdout.strip()
        return f"C (`{Path(where).name}`)" if where else "Python (the C extension is not built or ruled out)"
