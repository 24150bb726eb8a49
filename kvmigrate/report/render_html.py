"""HTML report: one self-contained page (inline CSS and SVG, no script, no network).

Two charts answer the first questions at a glance: how much of each namespace is
reusable (stacked bars by action) and where the bytes are by status. The tables below
are the same ones the text and Markdown reports print (kvmigrate.report.view).
"""

from __future__ import annotations

import html
import math
from collections import Counter
from typing import Any

from kvmigrate.report import view
from kvmigrate.report.summary import NEEDS_ACTIONS, REUSABLE_ACTIONS, STATUS_BITS
from kvmigrate.report.view import Table
from kvmigrate.units import agreeing, human_bytes, human_count, percent, plural

# Reusable actions in greens/teals, transforms that lack a number in amber, the rest grey.
ACTION_COLORS = {
    "already_present": "#1b5e20", "link": "#2e7d32", "rekey": "#388e3c", "copy_pad": "#43a047", "rewrite_header": "#66bb6a",
    "slice": "#00897b", "concat": "#00796b", "relayout": "#004d40", "reshard": "#00695c",
    "replicas": "#b2dfdb",
    "needs_slice": "#ffb300", "needs_concat": "#ffa000", "needs_relayout": "#ff8f00",
    "needs_reshard": "#ff6f00",
    "none": "#bdbdbd",
}
# a count of findings of each severity in words (the tile: "9 findings to act on (3 integrity problems, ...)")
SEVERITY_NOUNS = {"operational": "operational error", "integrity": "integrity problem", "finding": "other finding"}
SEVERITY_COLORS = {"note": "#78909c", "finding": "#f9a825", "integrity": "#c62828", "operational": "#6a1b9a",
                   "ok": "#2e7d32"}

CSS = """
:root { --fg:#1f2328; --muted:#59636e; --line:#d1d9e0; --bg:#ffffff; --soft:#f6f8fa; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color: var(--fg); background: var(--bg); margin: 0 auto; padding: 24px 32px 48px; max-width: 1400px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 32px 0 10px; padding-bottom: 4px; border-bottom: 1px solid var(--line); }
h3 { font-size: 15px; margin: 0; display: inline; }
code, pre, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "Liberation Mono", monospace;
                   font-size: 12.5px; }
.root { color: var(--muted); margin: 0 0 12px; word-break: break-all; }
dl.meta { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 0; color: var(--muted); }
dl.meta dt { font-weight: 600; }
dl.meta dd { margin: 0; word-break: break-all; }
.tiles { display: flex; flex-wrap: wrap; gap: 12px; margin: 20px 0 0; }
.tile { border: 1px solid var(--line); border-radius: 8px; padding: 10px 16px; min-width: 170px; background: var(--soft); }
.tile .v { font-size: 22px; font-weight: 650; }
.tile .l { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.tile.bad { border-color: #c62828; } .tile.warn { border-color: #f9a825; } .tile.good { border-color: #2e7d32; }
figure { margin: 0 0 20px; }
figcaption { font-weight: 600; margin-bottom: 6px; }
svg text { font-family: system-ui, -apple-system, "Segoe UI", Roboto, Arial, sans-serif; font-size: 12px; fill: #1f2328; }
svg text.muted { fill: #59636e; }
table { border-collapse: collapse; margin: 6px 0 12px; font-size: 13px; }
th, td { border: 1px solid var(--line); padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: var(--soft); font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
td.num { white-space: nowrap; }
td.name { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px;
          overflow-wrap: anywhere; min-width: 9em; }  /* long folder names wrap: the last columns stay on screen */
td.msg { min-width: 16em; overflow-wrap: anywhere; }
.scroll { overflow-x: auto; }
svg.chart { max-width: 100%; height: auto; }
details.notes { margin-top: 12px; }
ol.hints li { margin-bottom: 10px; }
ol.hints pre { background: var(--soft); border: 1px solid var(--line); border-radius: 6px; padding: 6px 10px;
               margin: 4px 0 0; white-space: pre-wrap; word-break: break-all; }
.sev { display: inline-block; padding: 0 6px; border-radius: 10px; color: #fff; font-size: 12px; }
details { border: 1px solid var(--line); border-radius: 8px; padding: 8px 12px; margin: 8px 0; }
details > summary { cursor: pointer; }
details dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 10px 0; }
details dt { color: var(--muted); } details dd { margin: 0; word-break: break-word; }
footer { margin-top: 40px; color: var(--muted); font-size: 12px; }
"""


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def table_html(t: Table) -> str:
    head = "".join(f'<th{" class=num" if i in t.numeric else ""}>{esc(h)}</th>' for i, h in enumerate(t.headers))
    rows = []
    for row in t.rows:
        cells = []
        for i, c in enumerate(row):
            cls = "num" if i in t.numeric else "name" if i in t.names else ""
            if t.key == "findings" and i == len(row) - 1:
                cls = "msg"
            if t.key in ("findings",) and i == 0:
                color = SEVERITY_COLORS.get(c, "#78909c")
                cells.append(f'<td><span class="sev" style="background:{color}">{esc(c)}</span></td>')
                continue
            cells.append(f'<td class="{cls}">{esc(c)}</td>' if cls else f"<td>{esc(c)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    if not rows:
        return "<p>none</p>"
    return (f'<div class="scroll"><table id="t-{esc(t.key)}"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


def pairs_html(pairs: list[tuple[str, str]], cls: str = "meta") -> str:
    return f'<dl class="{cls}">' + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in pairs) + "</dl>"


def _short(text: str, n: int = 46) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def reuse_chart(s: dict[str, Any]) -> str:
    """Stacked bars per namespace: bytes by action (reusable first), replicas, not reusable."""
    label_w, bar_w, value_w, row_h, top = 330, 520, 230, 26, 34
    keys = [a for a in REUSABLE_ACTIONS] + ["replicas"] + list(NEEDS_ACTIONS) + ["none"]
    rows = []
    for n in s["namespaces"]:
        parts = {a: n["by_action"].get(a, {}).get("bytes", 0) for a in keys if a != "replicas"}
        parts["replicas"] = n["replicas"]["bytes"]
        rows.append((n, parts, sum(parts.values())))
    widest = max((total for _, _, total in rows), default=0) or 1
    used = [k for k in keys if any(p[k] for _, p, _ in rows)] or ["none"]
    height = top + row_h * max(len(rows), 1) + 10
    width = label_w + bar_w + value_w
    out = [f'<svg role="img" id="svg-reuse" class="chart" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" aria-label="Reusable versus not reusable bytes per namespace">']
    x = label_w
    for k in used:  # legend
        label = "replica copies" if k == "replicas" else k
        out.append(f'<rect x="{x}" y="6" width="12" height="12" fill="{ACTION_COLORS[k]}"/>'
                   f'<text x="{x + 16}" y="16">{esc(label)}</text>')
        x += 24 + 7 * len(label)
    for i, (n, parts, total) in enumerate(rows):
        y = top + i * row_h
        name = n["source_base"]
        out.append(f'<text x="{label_w - 8}" y="{y + 15}" text-anchor="end"><title>{esc(name)}</title>'
                   f'{esc(_short(name))}</text>')
        at = float(label_w)  # where the next segment starts
        out.append(f'<rect x="{label_w}" y="{y + 3}" width="{bar_w}" height="16" fill="#f6f8fa"/>')
        for k in keys:
            if not parts[k]:
                continue
            w = max(bar_w * parts[k] / widest, 3)
            label = "replica copies" if k == "replicas" else k
            out.append(f'<rect class="seg-{esc(k)}" x="{at:.1f}" y="{y + 3}" width="{w:.1f}" height="16" '
                       f'fill="{ACTION_COLORS[k]}"><title>{esc(name)}: {esc(label)} {esc(human_bytes(parts[k]))}'
                       f'</title></rect>')
            at += w
        reusable = n["reusable"]["bytes"]
        out.append(f'<text x="{label_w + bar_w + 10}" y="{y + 15}">{esc(human_bytes(total))} · '
                   f'{esc(percent(reusable, total - n["replicas"]["bytes"]))} reusable</text>')
    if not rows:
        out.append(f'<text x="{label_w}" y="{top + 15}" class="muted">no namespaces</text>')
    out.append("</svg>")
    return "".join(out)


def status_chart(s: dict[str, Any]) -> str:
    """Horizontal bars: bytes by status, coloured by the severity of the status. The scale
    is logarithmic with a floor (`STATUS_MIN_BAR`) so a defect of a few KiB beside
    terabytes of healthy blocks is still a bar, not an invisible sliver; the exact bytes
    and files are printed beside each bar."""
    label_w, bar_w, value_w, row_h, top = 170, 600, 230, 24, 8
    items = list(s["totals"]["by_status"].items())
    widest = max((c["bytes"] for _, c in items), default=0)
    height = top + row_h * max(len(items), 1) + 8
    width = label_w + bar_w + value_w
    out = [f'<svg role="img" id="svg-status" class="chart" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" aria-label="Bytes by status (log scale)">']
    for i, (status, c) in enumerate(items):
        y = top + i * row_h
        bits = STATUS_BITS.get(status, 1)
        color = SEVERITY_COLORS["ok"] if status == "ok" else SEVERITY_COLORS[
            "operational" if bits & 8 else "integrity" if bits & 4 else "finding" if bits & 1 else "note"]
        w = log_bar(c["bytes"], widest, bar_w)
        files = plural(c["files"], "file")
        out.append(f'<text x="{label_w - 8}" y="{y + 15}" text-anchor="end">{esc(status)}</text>'
                   f'<rect class="status-{esc(status)}" x="{label_w}" y="{y + 3}" width="{w:.1f}" height="16" '
                   f'fill="{color}"><title>{esc(status)}: {esc(files)}, {c["bytes"]:,} bytes</title></rect>'
                   f'<text x="{label_w + w + 8:.1f}" y="{y + 15}">{esc(human_bytes(c["bytes"]))} · '
                   f'{esc(files)}</text>')
    out.append("</svg>")
    return "".join(out)


STATUS_MIN_BAR = 6  # viewBox units: >= 4 px even when the chart is scaled to an 800 px screen


def log_bar(value: int, widest: int, bar_w: float) -> float:
    """Width of a bar on a log scale from STATUS_MIN_BAR (0 bytes, 1 byte) to bar_w (the widest)."""
    if widest <= 1 or value <= 1:
        return float(STATUS_MIN_BAR)
    return STATUS_MIN_BAR + (bar_w - STATUS_MIN_BAR) * math.log(value) / math.log(widest)


def _tiles(s: dict[str, Any]) -> str:
    t = s["totals"]
    problems = sum(1 for f in s["findings"] if f["severity"] != "note")
    notes = len(s["findings"]) - problems
    severities = Counter(f["severity"] for f in s["findings"] if f["severity"] != "note")
    by_severity = ", ".join(plural(n, SEVERITY_NOUNS[sev]) for sev, n in severities.items())
    tiles = [
        ("", human_bytes(t["bytes"]), f"{plural(t['files'], 'file')} in {plural(t['namespaces'], 'namespace')}"),
        ("good" if t["reusable"]["bytes"] else "", human_bytes(t["reusable"]["bytes"]),
         f"reusable ({percent(t['reusable']['bytes'], t['block_bytes'] - t['replicas']['bytes'])}, "
         f"{plural(t['reusable']['blocks'], 'block')})"),
        ("warn" if t["pending"]["blocks"] else "", human_count(t["pending"]["blocks"]),
         f"{agreeing(t['pending']['blocks'], 'block')} pending ({human_bytes(t['pending']['bytes'])})"),
        ("", human_bytes(t["not_reusable"]["bytes"]), f"not reusable ({plural(t['not_reusable']['blocks'], 'block')})"),
        ("bad" if any(f["bits"] & 12 for f in s["findings"]) else "warn" if problems else "good", str(problems),
         f"{agreeing(problems, 'finding')} to act on" + (f" ({by_severity})" if by_severity else "")
         + (f", {plural(notes, 'note')}" if notes else "")),
        ("bad" if s["exit_code"] & 12 else "warn" if s["exit_code"] else "good", f"exit {s['exit_code']}",
         f"exit code = {view.exit_bits_label(s['exit_code'])}"),
    ]
    return '<section class="tiles">' + "".join(
        f'<div class="tile {c}"><div class="v">{esc(v)}</div><div class="l">{esc(label)}</div></div>'
        for c, v, label in tiles) + "</section>"


def _notes(s: dict[str, Any]) -> str:
    """The notes folded under one closed <details>: one line per distinct note, with the
    namespaces it applies to, so repeated assumed facts do not push the findings away."""
    t = view.folded_notes_table(s)
    if not t.rows:
        return ""
    codes = Counter(f["code"] for f in s["findings"] if f["severity"] == "note")
    what = ", ".join(f"{code} ×{k}" if k > 1 else code for code, k in codes.items())
    return (f'<details class="notes"><summary>{plural(sum(codes.values()), "note")} ({esc(what)}), '
            f'{len(t.rows)} distinct</summary>{table_html(t)}</details>')


def _hints(hints: list[dict[str, Any]]) -> str:
    if not hints:
        return "<p>Nothing to do.</p>"
    items = []
    for h in hints:
        where = f' <span class="mono">[{esc(", ".join(h["namespaces"]))}]</span>' if h["namespaces"] else ""
        items.append(f"<li>{esc(h['why'])}{where}<pre><code>{esc(h['command'])}</code></pre></li>")
    return '<ol class="hints">' + "".join(items) + "</ol>"


def _tiers(s: dict[str, Any]) -> str:
    """The LMCache tiers: the tier table, then per tier its deployments (view.tier_blocks)."""
    t = view.tier_table(s)
    if t is None:
        return ""
    out = [f'<section id="tiers"><h2>{esc(t.title)}</h2>{table_html(t)}']
    for title, pairs, deps in view.tier_blocks(s):
        out.append(f'<details class="tier" open><summary><h3 class="mono">{esc(title)}</h3></summary>'
                   + pairs_html(pairs, cls=""))
        for label, dpairs, tables in deps:
            out.append(f'<details class="deployment" open><summary><h3 class="mono">{esc(label)}</h3></summary>'
                       + pairs_html(dpairs, cls="")
                       + "".join(f"<p>{esc(tb.title)}</p>{table_html(tb)}" for tb in tables) + "</details>")
        out.append("</details>")
    out.append("</section>")
    return "".join(out)


def _stores(s: dict[str, Any]) -> str:
    """The Mooncake stores: the store table, then per store its deployments (view.store_blocks)."""
    t = view.store_table(s)
    if t is None:
        return ""
    out = [f'<section id="stores"><h2>{esc(t.title)}</h2>{table_html(t)}']
    for title, pairs, tables, deps in view.store_blocks(s):
        out.append(f'<details class="store" open><summary><h3 class="mono">{esc(title)}</h3></summary>'
                   + pairs_html(pairs, cls="") + "".join(f"<p>{esc(tb.title)}</p>{table_html(tb)}" for tb in tables))
        for label, dpairs, dtables in deps:
            out.append(f'<details class="deployment" open><summary><h3 class="mono">{esc(label)}</h3></summary>'
                       + pairs_html(dpairs, cls="")
                       + "".join(f"<p>{esc(tb.title)}</p>{table_html(tb)}" for tb in dtables) + "</details>")
        out.append("</details>")
    out.append("</section>")
    return "".join(out)


def _page(title: str, body: str) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body>{body}"
            "<footer>Generated by kvmigrate. Self-contained: no scripts, no network.</footer></body></html>\n")


def render(s: dict[str, Any]) -> str:
    body = [f"<header><h1>kvmigrate report</h1><p class=\"root mono\">{esc(s['root'])}</p>",
            pairs_html(view.header_pairs(s)), "</header>", _tiles(s),
            '<section id="charts"><h2>At a glance</h2>',
            '<figure id="chart-reuse"><figcaption>Reusable vs not, per namespace (bytes of block files)'
            "</figcaption>", reuse_chart(s), "</figure>",
            '<figure id="chart-status"><figcaption>Bytes by status (log scale, so a small defect is still a bar: '
            "the exact values are beside each bar)</figcaption>", status_chart(s), "</figure>",
            "</section>",
            '<section id="next"><h2>What to do next</h2>', _hints(s["hints"]), "</section>",
            '<section id="totals"><h2>Totals</h2>', pairs_html(view.totals_pairs(s)), "</section>"]
    for t in (view.namespace_table(s), view.reuse_table(s), view.status_table(s["totals"]["by_status"]),
              view.action_table(s["totals"]["by_action"], merges=s["totals"].get("merge_duplicates")),
              view.reclaim_table(s)):
        if t is not None:
            body.append(f'<section id="{esc(t.key)}"><h2>{esc(t.title)}</h2>{table_html(t)}</section>')
    body.append(f'<section id="findings"><h2>Findings</h2>{table_html(view.findings_table(s, notes=False))}'
                f'{_notes(s)}</section>')
    body.append(_tiers(s))
    body.append(_stores(s))
    body.append('<section id="details"><h2>Namespace details</h2>')
    for n in s["namespaces"]:
        body.append(f'<details class="namespace" open><summary><h3 class="mono">{esc(n["source_base"])}</h3>'
                    f' — {esc(view.gate_label(n))}, {esc(human_bytes(n["bytes"]))}</summary>'
                    + pairs_html(view.namespace_details(n), cls="")
                    + table_html(view.status_table(n["by_status"], key=f"status-{n['source_base']}"))
                    + (table_html(view.action_table(n["by_action"], key=f"actions-{n['source_base']}",
                                                   merges=n.get("merge_duplicates")))
                       if n["by_action"] else "")
                    + "</details>")
    body.append("</section>")
    return _page(f"kvmigrate report — {s['root']}", "".join(body))


def render_diff(d: dict[str, Any]) -> str:
    body = ["<header><h1>kvmigrate report --diff</h1>", pairs_html(view.diff_totals_pairs(d)), "</header>"]
    for t in view.diff_tables(d):
        body.append(f'<section id="{esc(t.key)}"><h2>{esc(t.title)}</h2>{table_html(t)}</section>')
    body.append(f'<section id="next"><h2>What to do next</h2>{_hints(d["hints"])}</section>')
    return _page("kvmigrate report --diff", "".join(body))


def render_trend(tr: dict[str, Any]) -> str:
    """report --trend --format html: one stacked bar per kept audit (bytes by status,
    coloured by severity) and the trend table, self-contained like the report."""
    audits = tr["audits"]
    statuses = sorted({st for a in audits for st in a["by_status"]})
    label_w, bar_w, value_w, row_h, top = 260, 560, 150, 24, 8
    widest = max((a["bytes"] for a in audits), default=0) or 1
    height = top + row_h * max(len(audits), 1) + 8
    width = label_w + bar_w + value_w
    out = [f'<svg role="img" id="svg-trend" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" aria-label="Bytes by status, per kept audit">']
    for i, a in enumerate(audits):
        y = top + i * row_h
        x = float(label_w)
        out.append(f'<text x="{label_w - 8}" y="{y + 15}" text-anchor="end">{esc(_short(a["name"], 40))}</text>')
        for st in statuses:
            c = a["by_status"].get(st)
            if not c or not c["bytes"]:
                continue
            bits = STATUS_BITS.get(st, 1)
            color = SEVERITY_COLORS["ok"] if st == "ok" else SEVERITY_COLORS[
                "operational" if bits & 8 else "integrity" if bits & 4 else "finding" if bits & 1 else "note"]
            w = max(bar_w * c["bytes"] / widest, 1.5)
            out.append(f'<rect class="status-{esc(st)}" x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="16" '
                       f'fill="{color}"><title>{esc(a["name"])} {esc(st)}: {esc(plural(c["files"], "file"))}, '
                       f'{esc(human_bytes(c["bytes"]))}</title></rect>')
            x += w
        out.append(f'<text x="{x + 8:.1f}" y="{y + 15}">{esc(human_bytes(a["bytes"]))} · exit {a["exit_code"]}</text>')
    out.append("</svg>")
    head = ["audit", "exit", "files", "bytes", *[f"{st} files" for st in statuses]]
    rows = "".join("<tr>" + "".join(f"<td>{esc(v)}</td>" for v in (
        a["name"], a["exit_code"], human_count(a["files"]), human_bytes(a["bytes"]),
        *[human_count(a["by_status"].get(st, {}).get("files", 0)) for st in statuses])) + "</tr>" for a in audits)
    table = ("<table><thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr></thead><tbody>"
             + rows + "</tbody></table>")
    body = (f"<h1>kvmigrate: {len(audits)} kept audits</h1><h2>Bytes by status</h2>{''.join(out)}"
            f"<h2>Files by status</h2>{table}")
    return _page("kvmigrate audit trend", body)
