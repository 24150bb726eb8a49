"""The comparison groups (meta, hash4k, hash1m, migrate, flat, cold*, scale), start-up and
the profile: what each times, against which peers."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

import profile_spy  # scripts/profile_spy.py: py-spy's side of --profile

from .harness import FACTS, SCRIPTS, Command, Group, Run, q, rmtree, run_measured, sh, tail
from .trees import SCALE_TREES

FLOOR_NOTE = ("The Python floor (scripts/floor_walk.py) is a reference, not a competitor: the bare walk and "
              "per-file syscalls in Python (by path), in the same number of processes, with no "
              "classification and no manifest: no pure-Python scanner can beat it. kvmigrate's compiled "
              "leaf walk (kvmigrate/_leafwalk.c, when built) makes those syscalls from C by file "
              "descriptor, so the two compare the cost of everything else: classification, rows, the "
              "manifest.")



def count_jdupes_groups(path: str) -> int:
    """jdupes prints each set of duplicates as lines separated by one blank line."""
    groups = 0
    in_group = False
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                if not in_group:
                    groups += 1
                in_group = True
            else:
                in_group = False
    return groups


def count_rmlint_groups(path: str) -> int | str:
    """Duplicate sets rmlint reported: its JSON's closing summary, read from the file's end.
    The whole JSON of a 1M-file tree is hundreds of MiB; loading it would raise this process's
    peak RSS, which the kernel hands on to every command started after (see reset_peak_rss)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            tail_text = f.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"not counted ({exc})"
    start, end = tail_text.rfind("{"), tail_text.rfind("}")
    try:
        summary = json.loads(tail_text[start:end + 1]) if 0 <= start < end else {}
    except ValueError as exc:
        return f"not counted ({exc})"
    return summary.get("duplicate_sets", "not counted (no summary)")


def fio_facts(path: str) -> dict:
    """fio's read bandwidth and bytes (its JSON output)."""
    job = json.loads(Path(path).read_text())["jobs"][0]["read"]
    return {"bw_mib_s": round(job["bw_bytes"] / 2**20, 1), "io_bytes": job["io_bytes"],
            "runtime_s": round(job["runtime"] / 1000, 3)}



def count_rdfind_groups(path: str) -> int:
    """rdfind's results file has one DUPTYPE_FIRST_OCCURRENCE line per duplicate set."""
    n = 0
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(b"DUPTYPE_FIRST_OCCURRENCE"):
                n += 1
    return n




class GroupsMixin:
    """The Bench's groups: each builds its commands on the trees (Bench has the state)."""

    def _scan_cmd(self, key: str, label: str, tree: str, verify: str, facts: tuple[str, ...] = ()) -> Command:
        root = self.tree_root(tree)
        out = self.out / f"{key}.parquet"
        stdout = str(self.out / f"{key}.json")
        argv = [self.kvm, "scan", str(root), "--verify", verify, "-q", "--json", "-o", str(out), *FACTS, *facts]
        if self.args.threads:
            argv += ["--threads", str(self.args.threads)]
        ok, why = self.kvm_has("scan")

        def check(_run: Run) -> dict:
            summary = json.loads(Path(stdout).read_text())
            facts = {"files": summary["totals"]["files"], "bytes": summary["totals"]["bytes"],
                     "by_status": {s: v["files"] for s, v in summary["totals"]["by_status"].items()},
                     "by_action": {a: v["blocks"] for a, v in summary["totals"]["by_action"].items()},
                     "exit_code": summary.get("exit_code")}
            if verify == "hash":
                facts["replica_groups"] = self.manifest_replica_groups(out)
            return facts

        return Command(key, label, argv, "kvmigrate", ok_rcs=(0, 1), stdout=stdout, check=check, available=ok,
                       why_unavailable=why)

    def manifest_replica_groups(self, manifest: Path) -> int | str:
        """Sets of >= 2 files with equal whole-file XXH3-128 in the manifest (what jdupes
        and rdfind report as duplicate sets), counted with kvmigrate's own interpreter."""
        code = ("import sys, pyarrow.compute as pc; from kvmigrate.manifest import read_table\n"
                "t = read_table(sys.argv[1], columns=['content_xxh3_128'])\n"
                "c = t.column('content_xxh3_128')\n"
                "nulls = c.null_count\n"
                "t = t.filter(pc.is_valid(c)).group_by('content_xxh3_128').aggregate([([], 'count_all')])\n"
                "print(pc.sum(pc.greater_equal(t.column('count_all'), 2)).as_py() or 0, nulls)\n")
        p = subprocess.run([self.kvm_python, "-c", code, str(manifest)], capture_output=True, text=True, cwd="/")
        if p.returncode != 0:
            return f"not counted ({(p.stderr.strip().splitlines() or ['?'])[-1]})"
        groups, nulls = p.stdout.split()
        if int(nulls):
            return f"{groups} ({nulls} rows without a content hash)"
        return int(groups)

    def group_meta(self) -> Group:
        root = self.tree_root("files4k")
        cmds = [
            self._scan_cmd("meta_kvm", "kvmigrate scan --verify size", "files4k", "size"),
            Command("meta_find", "find -printf", sh(f"find {q(root)} -type f -printf '%s %i %T@ %p\\n' > /dev/null"),
                    "baseline"),
            Command("meta_fd", "fdfind --type f", sh(f"fdfind -uu --type f . {q(root)} > /dev/null"), "baseline"),
            Command("meta_fd_l", "fdfind --type f -l", sh(f"fdfind -uu --type f -l . {q(root)} > /dev/null"),
                    "baseline"),
            self._floor_cmd("meta_floor", root, hashed=False),
        ]
        return Group("meta", "Metadata scan (4 KiB-file tree)", "files4k", cmds,
                     [("meta_kvm", "meta_find"), ("meta_kvm", "meta_fd"), ("meta_kvm", "meta_fd_l"),
                      ("meta_kvm", "meta_floor")],
                     note="find and fdfind only list (find also stats); kvmigrate also identifies namespaces, "
                          "classifies every block and writes the Parquet manifest. `fdfind` does not stat; "
                          "`fdfind -l` runs `ls -l` on batches of files. " + FLOOR_NOTE)

    def _floor_cmd(self, key: str, root: Path, hashed: bool) -> Command:
        """The Python floor (scripts/floor_walk.py): the same walk and reads in as many
        processes as kvmigrate uses, with nothing else (a reference, not a target)."""
        script = str(SCRIPTS / "floor_walk.py")
        return Command(key, f"Python floor ({'scandir + read + XXH3' if hashed else 'scandir + lstat'}, "
                            f"{len(os.sched_getaffinity(0))} processes, no manifest)",
                       [self.kvm_python, script, str(root), *(["--hash"] if hashed else [])], "baseline")

    def group_hash(self, key: str, tree: str) -> Group:
        root = self.tree_root(tree)
        out = self.out
        jd_out = str(out / f"{key}_jdupes.txt")
        rd_out = str(out / f"{key}_rdfind.txt")
        xx_out = str(out / f"{key}_xxhsum.count")
        cmds = [
            self._scan_cmd(f"{key}_kvm", "kvmigrate scan --verify hash", tree, "hash"),
            Command(f"{key}_xxhsum", "find | xargs xxhsum -H2",
                    sh(f"find {q(root)} -type f -print0 | xargs -0 xxhsum -H2 > /dev/null"), "baseline",
                    stdout=xx_out),
            Command(f"{key}_jdupes", "jdupes -r", ["jdupes", "-r", "-q", str(root)], "baseline", stdout=jd_out,
                    check=lambda _r: {"replica_groups": count_jdupes_groups(jd_out)}),
            Command(f"{key}_rdfind", "rdfind -dryrun true",
                    ["rdfind", "-dryrun", "true", "-outputname", rd_out, str(root)], "baseline",
                    stdout=str(out / f"{key}_rdfind.log"),
                    check=lambda _r: {"replica_groups": count_rdfind_groups(rd_out)}),
            self._floor_cmd(f"{key}_floor", root, hashed=True),
        ]
        spec = self.specs[tree]
        return Group(key, f"Content verification: {spec.title}", tree, cmds,
                     [(f"{key}_kvm", f"{key}_xxhsum"), (f"{key}_kvm", f"{key}_jdupes"),
                      (f"{key}_kvm", f"{key}_rdfind"), (f"{key}_kvm", f"{key}_floor"),
                      (f"{key}_floor", f"{key}_jdupes")],
                     note="Same files, same bytes: every file of the tree is read whole and hashed. "
                          "kvmigrate compares each block's rank replicas and writes the manifest; jdupes and "
                          "rdfind group equal files (their group counts are checked against the manifest's). "
                          + FLOOR_NOTE)

    def group_flat(self) -> Group:
        """A flat HiCache directory: the scan's flat path (scan/flat.py) against listing
        and hashing the same folder (xxhsum serial, and 8 processes of 512 files as a
        parallel hasher would)."""
        root = self.tree_root("flat")
        facts = ("--writer-layout", "page_first")  # the pages are then already_present for sglang-0.5.23
        cmds = [
            self._scan_cmd("flat_kvm_size", "kvmigrate scan --verify size", "flat", "size", facts),
            Command("flat_find", "find -printf",
                    sh(f"find {q(root)} -maxdepth 1 -type f -printf '%s %i %T@ %p\\n' > /dev/null"), "baseline"),
            self._scan_cmd("flat_kvm_hash", "kvmigrate scan --verify hash", "flat", "hash", facts),
            Command("flat_xxhsum", "find | xargs xxhsum -H2",
                    sh(f"find {q(root)} -maxdepth 1 -type f -print0 | xargs -0 xxhsum -H2 > /dev/null"), "baseline"),
            Command("flat_xxhsum_p8", "find | xargs -P8 -n512 xxhsum -H2",
                    sh(f"find {q(root)} -maxdepth 1 -type f -print0 | xargs -0 -P8 -n512 xxhsum -H2 > /dev/null"),
                    "baseline"),
        ]
        return Group("flat", f"Flat directory: {self.specs['flat'].title}", "flat", cmds,
                     [("flat_kvm_size", "flat_find"), ("flat_kvm_hash", "flat_xxhsum"),
                      ("flat_kvm_hash", "flat_xxhsum_p8")],
                     note="One folder, no rank or bucket folders: kvmigrate parses every name, groups the files "
                          "into deployments and writes the manifest (in one process, part 0: the C extension "
                          "stats or reads and hashes the pages by file descriptor in a few threads, the family's "
                          "Python code holds one record a file for its verdicts); find and xxhsum only list or "
                          "hash (xargs -P8 -n512: eight xxhsum processes at a time, 512 files each).")

    def hash_io_depth(self) -> int:
        """Reads in flight of the measured kvmigrate's default `scan --verify hash`
        (processes x threads a process), asked from its own parallelism()."""
        code = ("from kvmigrate.scan.parallel import parallelism, PARALLEL_MIN_BUCKETS as B\n"
                "w, t = parallelism(None, None, 'hash', B); print(w * t)")
        p = subprocess.run([self.kvm_python, "-c", code], capture_output=True, text=True, cwd="/")
        return int(p.stdout.strip()) if p.returncode == 0 and p.stdout.strip().isdigit() else 8

    def group_cold(self, key: str, tree: str) -> Group:
        """Cold reads (issue 22): the page cache, dentries and inodes dropped before every
        timed command (run_group(cold=True)). The peers: find -printf, xxhsum in 4 x cores
        processes of 512 files (the fastest way a user gets the same hashes), rmlint (a C
        duplicate finder; capped, the cap is a lower bound) and, on the 1 MiB tree, fio's
        sequential read of the same files with kvmigrate's reads in flight (the device's
        limit: O_DIRECT, so no page cache either way)."""
        root = self.tree_root(tree)
        out = self.out
        hashers = 4 * len(os.sched_getaffinity(0))
        depth = self.hash_io_depth()
        rm_json = str(out / f"{key}_rmlint.json")
        fio_json = str(out / f"{key}_fio.json")
        cmds = [
            self._scan_cmd(f"{key}_kvm_size", "kvmigrate scan --verify size", tree, "size"),
            Command(f"{key}_find", "find -printf", sh(f"find {q(root)} -type f -printf '%s %i %T@ %p\\n' > /dev/null"),
                    "baseline"),
            self._scan_cmd(f"{key}_kvm", "kvmigrate scan --verify hash", tree, "hash"),
            Command(f"{key}_xxhsum", f"find | xargs -P{hashers} -n512 xxhsum -H2",
                    sh(f"find {q(root)} -type f -print0 | xargs -0 -P{hashers} -n 512 xxhsum -H2 > /dev/null"),
                    "baseline"),
            Command(f"{key}_rmlint", "rmlint -T df (duplicate files)",
                    ["rmlint", "-T", "df", "-o", f"json:{rm_json}", str(root)], "baseline",
                    ok_rcs=(0, 1), max_runs=1, timeout_s=self.args.rmlint_timeout,
                    check=lambda _r: {"replica_groups": count_rmlint_groups(rm_json)}),
        ]
        pairs = [(f"{key}_kvm_size", f"{key}_find"), (f"{key}_kvm", f"{key}_xxhsum"), (f"{key}_kvm", f"{key}_rmlint")]
        if tree == "files1m":
            cmds.append(Command(f"{key}_fio", f"fio sequential read, O_DIRECT, iodepth {depth}",
                                ["fio", "--name=seqread", f"--opendir={root}", "--rw=read", "--bs=1M", "--direct=1",
                                 "--ioengine=libaio", f"--iodepth={depth}", "--group_reporting",
                                 "--output-format=json", f"--output={fio_json}"], "baseline",
                                check=lambda _r: fio_facts(fio_json)))
            pairs.append((f"{key}_kvm", f"{key}_fio"))
        spec = self.specs[tree]
        return Group(key, f"Cold: {spec.title} (page cache dropped before every command)", tree, cmds, pairs,
                     note="`sync; echo 3 > /proc/sys/vm/drop_caches` before every timed command: what a nightly "
                          "job meets on a cache larger than RAM. rmlint runs once (at most "
                          f"{self.args.rmlint_timeout:.0f} s: a longer run is stopped and its time is a lower "
                          "bound). fio reads the same files whole (O_DIRECT, 1 MiB requests, as many in flight "
                          f"as kvmigrate's hash scan has reads: {depth}); its bandwidth is its own (the time it "
                          "spends opening the files is not in it).")

    def group_scale(self) -> Group:
        """Scale with size (issue 22 item 4): scan --verify size, migrate --apply and
        report at 100k, 300k and 1M files (warm), time per file and peak RSS."""
        cmds = []
        for name in SCALE_TREES:
            root = self.tree_root(name)
            before = set(os.listdir(root))
            manifest = self.out / f"scale_{name}.parquet"

            def reset(root: Path = root, before: set = before) -> None:
                for extra in sorted(set(os.listdir(root)) - before):
                    rmtree(root / extra)

            rank0 = next((root / n for n in sorted(before) if n.endswith("_r0")), root)
            cp_dest = self.workdir / f"scale-cpal-{name}"

            def reset_cp(dest: Path = cp_dest) -> None:
                rmtree(dest)

            cmds += [
                Command(f"scale_{name}_scan", f"scan --verify size ({name})",
                        [self.kvm, "scan", str(root), "--verify", "size", "-q", "-o", str(manifest), *FACTS],
                        "kvmigrate", ok_rcs=(0, 1)),
                Command(f"scale_{name}_report", f"report M ({name})",
                        [self.kvm, "report", str(manifest), "-q", "--format", "json"], "kvmigrate", ok_rcs=(0, 1)),
                Command(f"scale_{name}_migrate", f"migrate --manifest M --apply ({name})",
                        [self.kvm, "migrate", "--manifest", str(manifest), "--apply", "-q"], "kvmigrate",
                        reset=reset),
                # the filesystem's own growth: as many hard links into a fresh tree of the same shape
                Command(f"scale_{name}_cpal", f"cp -al of the rank-0 folder ({name})",
                        ["cp", "-al", str(rank0), str(cp_dest)], "baseline", reset=reset_cp),
            ]
        sizes = ", ".join(f"{self.specs[n].files:,}" for n in SCALE_TREES)
        pairs = [(f"scale_{n}_migrate", f"scale_{n}_cpal") for n in SCALE_TREES]
        return Group("scale", f"Scale with size: {sizes} files of 4 KiB (warm)", SCALE_TREES[-1], cmds, pairs,
                     note="Each size is its own tree (llm-d TP=2 MLA, the same shape). `M` is the size scan's "
                          "manifest; migrate reads and checks both replicas of every block it links (what a "
                          "size manifest asks), and each run's links are removed after it (untimed). The "
                          "commands run in order (scan, report, migrate) the first time, so each has its manifest. `cp -al` "
                          "of the rank-0 folder makes as many hard links (one per block) into a fresh tree of the "
                          "same folder shape: the filesystem's own cost of linking at each size, for the migrate "
                          "row to be read against.")

    def group_migrate(self) -> Group:
        tree = "files4k"
        root = self.tree_root(tree)
        out = self.out
        manifest = out / "migrate_source.parquet"  # scan --verify hash: replicas proven equal by the scan
        manifest_size = out / "migrate_source_size.parquet"  # scan --verify size: apply reads the replicas
        rank0 = [p for p in sorted(root.iterdir()) if p.name.endswith("_r0")]
        cp_dest = self.workdir / "cpal"
        byhand_dest = self.workdir / "byhand"
        before = set(os.listdir(root))
        legacy = sorted(name for name in before if not name.startswith("."))  # base folder + rank folders

        def reset_root() -> None:
            """Delete what migrate created under ROOT: the new top-level target folders and
            kvmigrate's own .kvmigrate/ (journal, lock) — never a source folder."""
            for name in sorted(set(os.listdir(root)) - before):
                rmtree(root / name)

        def reset_cp() -> None:
            rmtree(cp_dest)

        def reset_byhand() -> None:
            rmtree(byhand_dest)

        ok_m, why_m = self.kvm_has("migrate")
        migrate_json = str(out / "migrate_manifest.json")
        migrate_size_json = str(out / "migrate_manifest_size.json")
        migrate_root_json = str(out / "migrate_root.json")

        def migrate_check(path: str) -> Any:
            def check(_run: Run) -> dict:
                summary = json.loads(Path(path).read_text())
                outcomes = summary.get("outcomes") or summary.get("apply", {}).get("outcomes") or {}
                return {"outcomes": outcomes, "expected_links": self.specs[tree].blocks,
                        "created_top_level": sorted(set(os.listdir(root)) - before),
                        "exit_code": summary.get("exit_code"), "verify": summary.get("verify")}
            return check

        def cp_check(dest: Path) -> Any:
            def check(_run: Run) -> dict:
                n = sum(len(files) for _d, _s, files in os.walk(dest))
                return {"files_linked": n, "expected_links": self.specs[tree].blocks}
            return check

        if ok_m:
            for verify, path in (("hash", manifest), ("size", manifest_size)):
                self.log(f"migrate: writing the source manifest (untimed scan --verify {verify})")
                err = out / f"migrate_source_{verify}.stderr"
                r = run_measured([self.kvm, "scan", str(root), "--verify", verify, "-q", "-o", str(path), *FACTS],
                                 stderr=str(err))
                if r.rc not in (0, 1):
                    ok_m, why_m = False, f"the scan that makes its manifest failed: {tail(err)}"
        src = rank0[0] if rank0 else root / "missing_r0"
        # the by-hand equivalent of a migration that proves the bytes it places: hash every
        # legacy file (both replicas of each block, as kvmigrate reads them) on every core,
        # then link the rank-0 files (the links kvmigrate makes) under a new name
        hashers = 4 * len(os.sched_getaffinity(0))
        byhand = (f"find {' '.join(q(root / n) for n in legacy)} -type f -print0 | "
                  f"xargs -0 -P{hashers} -n 512 xxhsum -H2 > /dev/null && "
                  f"mkdir -p {q(byhand_dest)} && cp -al {q(src)} {q(byhand_dest / 'target_r0')}")
        cmds = [
            Command("mig_kvm_root", "kvmigrate migrate ROOT --apply (scan + apply)",
                    [self.kvm, "migrate", str(root), "--apply", "-q", "--json", *FACTS], "kvmigrate",
                    stdout=migrate_root_json, reset=reset_root, check=migrate_check(migrate_root_json),
                    available=ok_m, why_unavailable=why_m),
            Command("mig_kvm_size", "kvmigrate migrate --manifest M(size) --apply",
                    [self.kvm, "migrate", "--manifest", str(manifest_size), "--apply", "-q", "--json"], "kvmigrate",
                    stdout=migrate_size_json, reset=reset_root, check=migrate_check(migrate_size_json),
                    available=ok_m, why_unavailable=why_m),
            Command("mig_byhand", "by hand: xxhsum -H2 of the legacy folders, then cp -al", sh(byhand), "baseline",
                    reset=reset_byhand, check=cp_check(byhand_dest)),
            Command("mig_cpal", "cp -al (rank 0 folder)", sh(f"mkdir -p {q(cp_dest)} && cp -al {q(src)} {q(cp_dest)}/"),
                    "baseline", reset=reset_cp, check=cp_check(cp_dest)),
            Command("mig_kvm", "kvmigrate migrate --manifest M --apply",
                    [self.kvm, "migrate", "--manifest", str(manifest), "--apply", "-q", "--json"], "kvmigrate",
                    stdout=migrate_json, reset=reset_root, check=migrate_check(migrate_json), available=ok_m,
                    why_unavailable=why_m),
        ]
        return Group("migrate", "Materialization: hard links (4 KiB-file tree)", tree, cmds,
                     [("mig_kvm_root", "mig_byhand"), ("mig_kvm_size", "mig_byhand"),
                      ("mig_kvm_root", "mig_cpal"), ("mig_kvm_size", "mig_cpal"), ("mig_kvm", "mig_cpal"),
                      ("mig_byhand", "mig_cpal")],
                     note="Every block's action is `link` (llm-d TP=2 MLA -> the vllm-0.28 replicated namespace): "
                          "kvmigrate links one replica per block (rank 0) into the target namespace. Every "
                          "repetition starts from the legacy tree alone: the created target folders (and "
                          ".kvmigrate/) or the cp destination are deleted after each command (untimed). "
                          "`ROOT` runs `migrate ROOT --apply` with its default flags, its own scan included "
                          "(the scan level it used is its `verify` below). `M(size)` is the manifest of "
                          "`scan --verify size`: before linking, apply reads and hashes both replicas of every "
                          "block. *By hand* is what an operator would type for the same safety: `xxhsum -H2` "
                          f"of every file of the legacy folders ({hashers} parallel xxhsum processes of 512 "
                          "files, 4 per core), which proves the bytes, then `cp -al` of the rank-0 folder (the "
                          "same links) to a new name; the ROOT and M(size) runs are judged against it (goal "
                          "<= 1.0x). Plain `cp -al` of the same rank-0 files, which checks nothing, stays as the "
                          "reference. `M` is the manifest of `scan --verify hash`: the scan proved every "
                          "block's two replicas equal, so apply only checks each source is unchanged (lstat) "
                          "and links: the materialization proper, against plain `cp -al`.",
                     items=self.specs[tree].blocks, item_name="links")

    def run_startup(self) -> dict:
        n = self.args.startup_runs
        res: dict[str, Any] = {"runs": n}
        for key, argv in (("kvmigrate_help", [self.kvm, "--help"]),
                          ("python_floor", [self.kvm_python, "-c", "pass"]),
                          ("python_import_kvmigrate_cli", [self.kvm_python, "-c", "import kvmigrate.cli"]),
                          ("python_import_kvmigrate_scan", [self.kvm_python, "-c", "import kvmigrate.scan"])):
            walls = []
            rss = 0
            for _ in range(n):
                r = run_measured(argv)
                walls.append(r.wall_s)
                rss = max(rss, r.maxrss_kib)
            res[key] = {"command": " ".join(q(a) for a in argv), "median_s": round(statistics.median(walls), 4),
                        "min_s": round(min(walls), 4), "max_s": round(max(walls), 4),
                        "peak_rss_mib": round(rss / 1024, 1)}
        p = subprocess.run([self.kvm_python, "-X", "importtime", "-c", "import kvmigrate.cli"],
                           capture_output=True, text=True)
        rows = []
        for ln in p.stderr.splitlines():
            parts = ln.replace("import time:", "").split("|")
            if len(parts) == 3 and parts[1].strip().isdigit():
                rows.append((int(parts[1]), parts[2].rstrip()))
        res["importtime_top_cumulative_us"] = [f"{us} {name}" for us, name in sorted(rows, reverse=True)[:8]]
        loaded = subprocess.run([self.kvm_python, "-c", "import sys, kvmigrate.cli; "
                                 "print(' '.join(m for m in ('pyarrow','tqdm','xxhash') if m in sys.modules))"],
                                capture_output=True, text=True)
        res["heavy_modules_loaded_by_cli"] = loaded.stdout.split()
        self.log(f"startup: kvmigrate --help median {res['kvmigrate_help']['median_s'] * 1000:.0f} ms "
                 f"(python floor {res['python_floor']['median_s'] * 1000:.0f} ms)")
        return res

    def run_profile(self) -> dict:
        """Where `kvmigrate scan` spends its time on the 4 KiB tree: py-spy sampling the
        real run (parent and worker processes, scripts/profile_spy.py) when py-spy is
        installed, else cProfile of every thread of one process (scripts/profile_scan.py)."""
        root = self.tree_root("files4k")
        out = self.out
        top = ["--top", str(self.args.profile_top)]
        if profile_spy.find_py_spy(self.kvm_python):
            res: dict[str, Any] = {"tool": "py-spy (sampling, parent and worker processes; scripts/profile_spy.py)",
                                   "kind": "py-spy"}
            name = "py-spy"

            def profiler(verify: str, js: Path) -> list[str]:
                return [str(SCRIPTS / "profile_spy.py"), "--json", str(js), *top, "--kvmigrate", self.kvm]
        else:
            res = {"tool": "cProfile, all threads merged (scripts/profile_scan.py)"}
            name = "cProfile"

            def profiler(verify: str, js: Path) -> list[str]:
                return [str(SCRIPTS / "profile_scan.py"), "--out", str(out / f"profile_{verify}.pstats"),
                        "--json", str(js), *top]
        for verify in ("size", "hash"):
            js = out / f"profile_{'spy_' if name == 'py-spy' else ''}{verify}.json"
            argv = [self.kvm_python, *profiler(verify, js), "--", "scan", str(root), "--verify", verify, "-q",
                    "-o", str(out / f"profile_{verify}.parquet"), *FACTS]
            self.log(f"profile ({name}): scan --verify {verify}")
            p = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if p.returncode != 0 or not js.exists():
                res[verify] = {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
                continue
            res[verify] = json.loads(js.read_text())
        return res
