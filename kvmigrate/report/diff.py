"""What changed between two audits: new and vanished namespaces, growth, new findings.

Works on two summaries (so it costs two streaming passes, never a join of manifests).
A finding is a non-ok state per namespace; it is *new* when its file count appeared or
grew, *resolved* when it shrank or vanished. Bytes are split into held alone and shared
through hard links, with the data on disk (a hard-linked file counted once): a migration
by hard links adds shared bytes, not data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the JSON models are types only (kvmigrate.outputs)
    from kvmigrate.outputs import FileCount, Namespace, ReportOutput


DIFF_VERSION = 1
_QUIET_STATUSES = ("ok", "own_artifact")


def _ns_numbers(n: Namespace | None) -> dict[str, int]:
    if not n:
        return {"files": 0, "bytes": 0, "bytes_alone": 0, "bytes_shared": 0, "blocks": 0, "reusable_blocks": 0,
                "reusable_bytes": 0, "pending_blocks": 0}
    return {"files": n["files"], "bytes": n["bytes"], "bytes_alone": n["bytes_alone"],
            "bytes_shared": n["bytes_shared"], "blocks": n["blocks"],
            "reusable_blocks": n["reusable"]["blocks"], "reusable_bytes": n["reusable"]["bytes"],
            "pending_blocks": n["pending"]["blocks"]}


def _run(s: ReportOutput) -> dict[str, Any]:
    t = s["totals"]
    return {"manifest": s.get("manifest"), "root": s.get("root"), "command": s.get("command"),
            "exit_code": s["exit_code"],
            "totals": {"files": t["files"], "bytes": t["bytes"], "bytes_alone": t["bytes_alone"],
                       "bytes_shared": t["bytes_shared"], "data_bytes": t["data_bytes"], "blocks": t["blocks"],
                       "reusable_blocks": t["reusable"]["blocks"], "reusable_bytes": t["reusable"]["bytes"]}}


def _statuses(s: ReportOutput) -> dict[tuple[str | None, str], FileCount]:
    out: dict[tuple[str | None, str], FileCount] = {}
    for n in s["namespaces"]:
        for status, c in n["by_status"].items():
            out[(n["source_base"], status)] = c
    outside = s["outside_namespaces"]
    if outside:
        for status, c in outside["by_status"].items():
            out[(None, status)] = c
    return {k: v for k, v in out.items() if k[1] not in _QUIET_STATUSES}


def diff(old: ReportOutput, new: ReportOutput) -> dict[str, Any]:
    """Compare two summaries (`summarize` output) of the same root at two times."""
    old_ns = {n["source_base"]: n for n in old["namespaces"]}
    new_ns = {n["source_base"]: n for n in new["namespaces"]}
    namespaces = []
    for base in sorted(set(old_ns) | set(new_ns)):
        o, n = _ns_numbers(old_ns.get(base)), _ns_numbers(new_ns.get(base))
        delta = {k: n[k] - o[k] for k in n}
        change = "new" if base not in old_ns else "vanished" if base not in new_ns else (
            "changed" if any(delta.values()) else "same")
        if change != "same":
            namespaces.append({"source_base": base, "change": change, "old": o, "new": n, "delta": delta})
    before, after = _statuses(old), _statuses(new)
    new_findings, resolved = [], []
    for key in sorted(set(before) | set(after), key=lambda k: (k[0] or "", k[1])):
        b = before.get(key, {"files": 0, "bytes": 0})
        a = after.get(key, {"files": 0, "bytes": 0})
        entry = {"namespace": key[0], "status": key[1], "old_files": b["files"], "new_files": a["files"],
                 "old_bytes": b["bytes"], "new_bytes": a["bytes"]}
        if a["files"] > b["files"]:
            new_findings.append(entry)
        elif a["files"] < b["files"]:
            resolved.append(entry)
    return {
        "diff_version": DIFF_VERSION,
        "old": _run(old),
        "new": _run(new),
        "new_namespaces": sorted(set(new_ns) - set(old_ns)),
        "vanished_namespaces": sorted(set(old_ns) - set(new_ns)),
        "namespaces": namespaces,
        "new_findings": new_findings,
        "resolved_findings": resolved,
        "hints": new.get("hints", []),
        "exit_code": new["exit_code"],
    }
