"""What a run's timings add up to: per-group ratios, the same-answer check, the scale
figures and the issue's targets."""

from __future__ import annotations

from typing import Any

from .harness import Command, Group
from .trees import GROUP_TREES, SCALE_TREES


class FiguresMixin:
    """The Bench's figures from its timed groups: ratios, replica checks, scale, targets."""

    def group_dict(self, g: Group) -> dict:
        by_key = {c.key: c for c in g.commands}
        ratios = []
        for a, b in g.pairs:
            ca, cb = by_key[a], by_key[b]
            r = round(ca.median / cb.median, 3) if ca.median and cb.median else None
            ratios.append({"a": a, "b": b, "a_label": ca.label, "b_label": cb.label, "ratio_a_over_b": r})
        tree = self.trees.get(g.tree, {}).get("counts", {})
        items = g.items if g.items is not None else tree.get("files")
        cmds = []
        for c in g.commands:
            d = c.summary()
            if c.median and items:
                d["items_per_s"] = round(items / c.median)
                if g.items is None:
                    d["mib_per_s"] = round(tree["bytes"] / c.median / 2**20, 1)
            cmds.append(d)
        return {"key": g.key, "title": g.title, "tree": g.tree, "note": g.note, "item_name": g.item_name,
                "reps": g.reps,
                "items": items, "loadavg": g.loadavg, "commands": cmds, "ratios": ratios}

    def _cmd(self, key: str) -> Command | None:
        for g in self.groups:
            for c in g.commands:
                if c.key == key:
                    return c
        return None


    def replica_check(self) -> dict:
        out = {}
        for g in self.groups:
            if not g.key.startswith(("hash", "cold")):
                continue
            spec = self.specs[g.tree]
            row: dict[str, Any] = {"expected": spec.blocks}
            for suffix in ("kvm", "jdupes", "rdfind", "rmlint"):
                c = self._cmd(f"{g.key}_{suffix}")
                row[suffix] = c.facts.get("replica_groups") if c and c.facts else None
            counted = [v for k, v in row.items() if k != "expected" and v is not None]
            if counted and all(isinstance(v, int) for v in counted):
                row["agree"] = all(v == spec.blocks for v in counted)
            else:
                row["agree"] = None  # a count is missing: not checked
            kvm = self._cmd(f"{g.key}_kvm")
            if kvm and kvm.facts:
                row["kvmigrate_files"] = kvm.facts.get("files")
                row["tree_files"] = self.trees[g.tree]["counts"]["files"]
            out[g.key] = row
        return out

    def scale_figures(self) -> dict:
        """Per command of the scale group: per-file cost at each size, the ratio of the
        largest tree's to the smallest's, and the largest tree's peak RSS."""
        out: dict[str, dict] = {}
        for cmd in ("scan", "migrate", "report", "cpal"):
            rows = []
            for name in SCALE_TREES:
                c = self._cmd(f"scale_{name}_{cmd}")
                files = self.trees.get(name, {}).get("counts", {}).get("files")
                if not c or not c.median or not files:
                    break
                rows.append({"tree": name, "files": files, "median_s": round(c.median, 3),
                             "us_per_file": round(1e6 * c.median / files, 2),
                             "peak_rss_mib": c.summary()["peak_rss_mib"]})
            if len(rows) == len(SCALE_TREES):
                # per-file cost carries the fixed start-up, which flatters the largest tree; the marginal
                # cost (seconds per added file between sizes) does not
                a, b, c = rows[0], rows[1], rows[-1]
                low = (b["median_s"] - a["median_s"]) / (b["files"] - a["files"])
                high = (c["median_s"] - b["median_s"]) / (c["files"] - b["files"])
                out[cmd] = {"sizes": rows, "per_file_ratio": round(rows[-1]["us_per_file"] / rows[0]["us_per_file"], 3),
                            "marginal_us_per_file": [round(1e6 * low, 2), round(1e6 * high, 2)],
                            "marginal_ratio": round(high / low, 3) if low > 0 else None,
                            "largest_files": rows[-1]["files"], "largest_rss_mib": rows[-1]["peak_rss_mib"]}
        return out

    def targets(self) -> list[dict]:
        """The issue's "Done means", each as measured here."""
        large = self.scale == "large"
        res: list[dict] = []

        def ratio(a: str, b: str) -> float | None:
            ca, cb = self._cmd(a), self._cmd(b)
            return ca.median / cb.median if ca and cb and ca.median and cb.median else None

        def add(name: str, figure: float | None, limit: float, kind: str, unit: str, basis: str,
                strict: bool = False) -> None:
            if figure is None:
                res.append({"target": name, "figure": None, "limit": limit, "result": "not measured",
                            "basis": basis})
                return
            if kind == "max":
                passed = figure < limit if strict else figure <= limit
            else:
                passed = figure >= limit
            miss = ""
            if not passed:
                miss = (f"{figure / limit:.2f}x over the limit" if kind == "max"
                        else f"{limit / figure:.2f}x short of the target")
            res.append({"target": name, "figure": round(figure, 3), "unit": unit, "limit": limit, "kind": kind,
                        "strict": strict,
                        "result": "pass" if passed else "miss", "by": miss, "basis": basis,
                        "scale_note": "" if large else "small scale: indicative; the target is defined on the "
                                                        "large trees (1M files, 4 GiB)"})

        add("metadata scan <= 1.5x find -printf", ratio("meta_kvm", "meta_find"), 1.5, "max", "x",
            "kvmigrate scan --verify size / find -printf, medians, 4 KiB tree")
        for key, what in (("hash4k", "4 KiB files"), ("hash1m", "1 MiB files")):
            r = ratio(f"{key}_xxhsum", f"{key}_kvm")
            add(f"hash throughput >= 1.0x xxhsum -H2 ({what})", r, 1.0, "min", "x",
                "xxhsum time / kvmigrate scan --verify hash time (throughput ratio)")
            for tool in ("jdupes", "rdfind"):
                if (key, tool) == ("hash1m", "jdupes"):
                    continue  # retired (issue 22): under the start-up floor of any tool started in Python
                add(f"replica groups >= 3x faster than {tool} ({what})", ratio(f"{key}_{tool}", f"{key}_kvm"), 3.0,
                    "min", "x", f"{tool} time / kvmigrate scan --verify hash time")
        add("migrate --apply (links) <= 1.5x cp -al", ratio("mig_kvm", "mig_cpal"), 1.5, "max", "x",
            "kvmigrate migrate --manifest M --apply / cp -al, medians")
        for key, what in (("mig_kvm_root", "migrate ROOT --apply (default flags)"),
                          ("mig_kvm_size", "migrate --manifest M(size) --apply")):
            add(f"{what} <= 1.0x xxhsum -H2 + cp -al by hand (issue 16)", ratio(key, "mig_byhand"), 1.0, "max",
                "x", f"kvmigrate {what} / (xxhsum -H2 of the legacy folders, then cp -al), medians")
        if self._cmd("flat_kvm_size"):
            add("flat directory: scan --verify size <= 1.0x find -printf (issue 21)",
                ratio("flat_kvm_size", "flat_find"), 1.0, "max", "x",
                "kvmigrate scan --verify size / find -printf, medians, flat HiCache directory")
            add("flat directory: hash throughput >= 1.0x xxhsum -H2 (serial)", ratio("flat_xxhsum", "flat_kvm_hash"),
                1.0, "min", "x", "xxhsum time / kvmigrate scan --verify hash time, flat HiCache directory")
            flat_rss = [c.summary().get("peak_rss_mib") for c in (self._cmd("flat_kvm_size"),
                                                                   self._cmd("flat_kvm_hash")) if c]
            flat_rss = [x for x in flat_rss if x is not None]
            add("flat directory: scan peak RSS < 256 MiB", max(flat_rss) if flat_rss else None, 256, "max", "MiB",
                "max over the flat group's scan --verify size and --verify hash runs (os.wait4 ru_maxrss)",
                strict=True)
        rss = [c.summary().get("peak_rss_mib") for c in (self._cmd("meta_kvm"), self._cmd("hash4k_kvm")) if c]
        rss = [x for x in rss if x is not None]
        add("scan peak RSS < 256 MiB (4 KiB-file tree)", max(rss) if rss else None, 256, "max", "MiB",
            "max over scan --verify size and --verify hash runs (os.wait4 ru_maxrss)", strict=True)
        for key, what in (("cold4k", "1M files of 4 KiB" if large else "4 KiB files"), ("cold1m", "1 MiB files")):
            if not self._cmd(f"{key}_kvm"):
                continue
            add(f"cold: scan --verify size <= 0.5x find -printf ({what})", ratio(f"{key}_kvm_size", f"{key}_find"),
                0.5, "max", "x", "kvmigrate scan --verify size / find -printf, medians, page cache dropped before each")
            add(f"cold: hash throughput >= 1.5x xargs -P xxhsum -H2 ({what})", ratio(f"{key}_xxhsum", f"{key}_kvm"),
                1.5, "min", "x", "find | xargs -P(4 x cores) -n512 xxhsum -H2 time / kvmigrate scan --verify hash time")
            rm = self._cmd(f"{key}_rmlint")
            lower = bool(rm and any(r.timed_out for r in rm.runs))
            add(f"cold: replica groups >= 5x faster than rmlint ({what})", ratio(f"{key}_rmlint", f"{key}_kvm"), 5.0,
                "min", "x", "rmlint -T df time / kvmigrate scan --verify hash time"
                + (" (rmlint stopped at its timeout: the figure is a lower bound)" if lower else ""))
            if lower and res[-1].get("figure") is not None:
                res[-1]["lower_bound"] = True
            fio, kvm = self._cmd(f"{key}_fio"), self._cmd(f"{key}_kvm")
            if fio and kvm and kvm.median and fio.facts.get("bw_mib_s"):
                kvm_bw = self.trees[GROUP_TREES[key]]["counts"]["bytes"] / kvm.median / 2**20
                add(f"cold: hash scan bandwidth >= 0.8x fio sequential read ({what})", kvm_bw / fio.facts["bw_mib_s"],
                    0.8, "min", "x", f"kvmigrate {kvm_bw:.0f} MiB/s (tree bytes / median) / fio "
                    f"{fio.facts['bw_mib_s']:.0f} MiB/s (its own bandwidth, O_DIRECT, same reads in flight)")
        scale = self.scale_figures()
        scale.pop("cpal", None)  # a reference for migrate's row, not a target of ours
        for cmd, f in scale.items():
            add(f"scale: {cmd} time per file at {SCALE_TREES[-1]} / at {SCALE_TREES[0]} <= 1.1", f.get("per_file_ratio"),
                1.1, "max", "x", "median seconds per file, largest tree over smallest (linear: 1.0)")
            add(f"scale: {cmd} marginal time per file, {SCALE_TREES[1]} to {SCALE_TREES[-1]} / {SCALE_TREES[0]} to "
                f"{SCALE_TREES[1]} <= 1.1", f.get("marginal_ratio"), 1.1, "max", "x",
                "seconds per added file between sizes (the fixed start-up left out)")
            add(f"scale: {cmd} peak RSS < 256 MiB at {f['largest_files']:,} files", f.get("largest_rss_mib"), 256,
                "max", "MiB", "os.wait4 ru_maxrss, largest tree", strict=True)
        help_s = self.startup.get("kvmigrate_help", {}).get("median_s") if self.startup else None
        add("kvmigrate --help < 0.3 s", help_s, 0.3, "max", "s", f"median of {self.args.startup_runs} runs",
            strict=True)
        return res
