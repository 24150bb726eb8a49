"""Markdown report: GitHub tables that paste into a ticket, human units, hints as code."""

from __future__ import annotations

from typing import Any

from kvmigrate.report import view
from kvmigrate.report.view import Table


def cell(text: str) -> str:
    """Table-safe cell: pipes escaped, newlines flattened."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def code(text: str) -> str:
    fence = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def table_lines(t: Table) -> list[str]:
    if not t.rows:
        return ["_none_"]
    lines = ["| " + " | ".join(cell(h) for h in t.headers) + " |",
             "|" + "|".join("---:" if i in t.numeric else "---" for i in range(len(t.headers))) + "|"]
    for row in t.rows:
        cells = [cell(code(c)) if i in t.names and c != "-" else cell(c) for i, c in enumerate(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def pairs_table(pairs: list[tuple[str, str]]) -> list[str]:
    lines = ["| | |", "|---|---|"]
    lines += [f"| {cell(k)} | {cell(v)} |" for k, v in pairs]
    return lines


def hint_lines(hints: list[dict[str, Any]]) -> list[str]:
    if not hints:
        return ["Nothing to do."]
    lines = []
    for i, h in enumerate(hints, 1):
        where = f" ({', '.join(code(n) for n in h['namespaces'])})" if h["namespaces"] else ""
        lines += [f"{i}. {h['why']}{where}", "", "   ```sh", f"   {h['command']}", "   ```", ""]
    return lines


def render(s: dict[str, Any]) -> str:
    lines = [f"# kvmigrate report: {code(str(s['root']))}", ""]
    lines += pairs_table(view.header_pairs(s)) + ["", "## Totals", ""]
    lines += pairs_table(view.totals_pairs(s))
    for t in (view.namespace_table(s), view.reuse_table(s), view.status_table(s["totals"]["by_status"]),
              view.action_table(s["totals"]["by_action"], merges=s["totals"].get("merge_duplicates")),
              view.reclaim_table(s), view.findings_table(s)):
        if t is not None:
            lines += ["", f"## {t.title}", ""] + table_lines(t)
    lines += ["", "## What to do next", ""] + hint_lines(s["hints"])
    tiers = view.tier_table(s)
    if tiers is not None:
        lines += ["", f"## {tiers.title}", ""] + table_lines(tiers)
        for title, pairs, deps in view.tier_blocks(s):
            lines += ["", f"### {title}", ""] + pairs_table(pairs)
            for label, dpairs, tables in deps:
                lines += ["", f"#### {code(label)}", ""] + pairs_table(dpairs)
                for t in tables:
                    lines += ["", f"{t.title}:", ""] + table_lines(t)
    stores = view.store_table(s)
    if stores is not None:
        lines += ["", f"## {stores.title}", ""] + table_lines(stores)
        for title, pairs, tables, deps in view.store_blocks(s):
            lines += ["", f"### {title}", ""] + pairs_table(pairs)
            for t in tables:
                lines += ["", f"{t.title}:", ""] + table_lines(t)
            for label, dpairs, dtables in deps:
                lines += ["", f"#### {code(label)}", ""] + pairs_table(dpairs)
                for t in dtables:
                    lines += ["", f"{t.title}:", ""] + table_lines(t)
    lines += ["", "## Namespace details"]
    for n in s["namespaces"]:
        lines += ["", f"### {code(n['source_base'])}", ""] + pairs_table(view.namespace_details(n))
        lines += [""] + table_lines(view.status_table(n["by_status"]))
        if n["by_action"]:
            lines += [""] + table_lines(view.action_table(n["by_action"], merges=n.get("merge_duplicates")))
    return "\n".join(lines).rstrip() + "\n"


def render_diff(d: dict[str, Any]) -> str:
    lines = ["# kvmigrate report --diff", ""] + pairs_table(view.diff_totals_pairs(d))
    for t in view.diff_tables(d):
        lines += ["", f"## {t.title}", ""] + table_lines(t)
    lines += ["", "## What to do next", ""] + hint_lines(d["hints"])
    return "\n".join(lines).rstrip() + "\n"
