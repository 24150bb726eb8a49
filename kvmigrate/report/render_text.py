"""Plain-text report for a terminal: aligned tables, human units, hints last."""

from __future__ import annotations

from typing import Any

from kvmigrate.report import view
from kvmigrate.report.view import Table


def table_lines(t: Table, indent: str = "") -> list[str]:
    """Columns padded to their widest cell; numbers right-aligned."""
    widths = [len(h) for h in t.headers]
    for row in t.rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def fmt(row: list[str]) -> str:
        cells = [c.rjust(widths[i]) if i in t.numeric else c.ljust(widths[i]) for i, c in enumerate(row)]
        return (indent + "  ".join(cells)).rstrip()

    lines = [fmt([h.upper() for h in t.headers])]
    lines += [fmt(r) for r in t.rows]
    return lines


def pairs_lines(pairs: list[tuple[str, str]], indent: str = "  ") -> list[str]:
    width = max((len(k) for k, _ in pairs), default=0)
    return [f"{indent}{k.ljust(width)}  {v}" for k, v in pairs]


def _section(title: str) -> list[str]:
    return ["", title.upper(), ""]


def hint_lines(hints: list[dict[str, Any]]) -> list[str]:
    if not hints:
        return ["  nothing to do"]
    lines = []
    for i, h in enumerate(hints, 1):
        where = f" [{', '.join(h['namespaces'])}]" if h["namespaces"] else ""
        lines.append(f"  {i}. {h['why']}{where}")
        lines.append(f"     $ {h['command']}")
    return lines


def render(s: dict[str, Any]) -> str:
    lines = [f"kvmigrate report: {s['root']}"]
    lines += pairs_lines(view.header_pairs(s))
    lines += _section("Totals") + pairs_lines(view.totals_pairs(s))
    for t in (view.namespace_table(s), view.reuse_table(s), view.status_table(s["totals"]["by_status"]),
              view.action_table(s["totals"]["by_action"], merges=s["totals"].get("merge_duplicates"))):
        lines += _section(t.title) + table_lines(t)
    lines += _section("Namespace details")
    for n in s["namespaces"]:
        lines.append(n["source_base"])
        lines += pairs_lines(view.namespace_details(n))
        lines.append("")
        lines += table_lines(view.status_table(n["by_status"]), indent="  ")
        if n["by_action"]:
            lines.append("")
            lines += table_lines(view.action_table(n["by_action"], merges=n.get("merge_duplicates")), indent="  ")
        lines.append("")
    tiers = view.tier_table(s)
    if tiers is not None:
        lines += _section(tiers.title) + table_lines(tiers)
        for title, pairs, deps in view.tier_blocks(s):
            lines += ["", title]
            lines += pairs_lines(pairs)
            for label, dpairs, tables in deps:
                lines += ["", f"  {label}"]
                lines += pairs_lines(dpairs, indent="    ")
                for t in tables:
                    lines += [""] + table_lines(t, indent="    ")
    stores = view.store_table(s)
    if stores is not None:
        lines += _section(stores.title) + table_lines(stores)
        for title, pairs, tables, deps in view.store_blocks(s):
            lines += ["", title] + pairs_lines(pairs)
            for t in tables:
                lines += [""] + table_lines(t, indent="  ")
            for label, dpairs, dtables in deps:
                lines += ["", f"  {label}"] + pairs_lines(dpairs, indent="    ")
                for t in dtables:
                    lines += [""] + table_lines(t, indent="    ")
    reclaim = view.reclaim_table(s)
    if reclaim is not None:
        lines += _section(reclaim.title) + (table_lines(reclaim) if reclaim.rows else ["  nothing"])
    findings = view.findings_table(s)
    lines += _section("Findings") + (table_lines(findings) if findings.rows else ["  none"])
    lines += _section("What to do next") + hint_lines(s["hints"])
    return "\n".join(lines).rstrip() + "\n"


def render_diff(d: dict[str, Any]) -> str:
    lines = ["kvmigrate report --diff"]
    lines += pairs_lines(view.diff_totals_pairs(d))
    for t in view.diff_tables(d):
        lines += _section(t.title) + (table_lines(t) if t.rows else ["  none"])
    lines += _section("What to do next") + hint_lines(d["hints"])
    return "\n".join(lines).rstrip() + "\n"
