"""`report --trend`: files and bytes by status, and blocks by action, over the kept audits
(`audit --keep N`), oldest first: one streaming summary per kept manifest."""

from __future__ import annotations

import json
import os
from typing import Any

from kvmigrate.units import human_bytes


def trend(paths: list[str | os.PathLike[str]], summary_of: Any) -> dict[str, Any]:
    """{"audits": [{manifest, files, bytes, exit_code, by_status, by_action, carried?}, ...]}."""
    audits = []
    for p in paths:
        s = summary_of(p)
        t = s["totals"]
        audits.append({"manifest": str(p), "name": os.path.basename(str(p)), "exit_code": s["exit_code"],
                       "files": t["files"], "bytes": t["bytes"],
                       "by_status": {k: dict(v) for k, v in sorted(t["by_status"].items())},
                       "by_action": {k: dict(v) for k, v in sorted(t["by_action"].items())}})
    return {"trend_version": 1, "audits": audits}


def render_text(tr: dict[str, Any]) -> str:
    """One line per kept audit: totals, files by status, blocks by action."""
    audits = tr["audits"]
    if not audits:
        return "no kept audits (run `kvmigrate audit ROOT --keep N`)\n"
    statuses = sorted({s for a in audits for s in a["by_status"]})
    actions = sorted({x for a in audits for x in a["by_action"]})
    head = ["audit", "exit", "files", "bytes", *[f"{s} files" for s in statuses], *[f"{x} blocks" for x in actions]]
    rows = [head]
    for a in audits:
        rows.append([a["name"], str(a["exit_code"]), str(a["files"]), human_bytes(a["bytes"]),
                     *[str(a["by_status"].get(s, {}).get("files", 0)) for s in statuses],
                     *[str(a["by_action"].get(x, {}).get("blocks", 0)) for x in actions]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    return "\n".join(lines) + "\n"


def render_json(tr: dict[str, Any]) -> str:
    return json.dumps(tr, indent=2, sort_keys=True) + "\n"
