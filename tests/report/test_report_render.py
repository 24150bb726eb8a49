"""Every format shows the same numbers: JSON is parsed directly, text and Markdown by
regex on their table rows, HTML through its DOM text; all are compared with the raw
numbers of the JSON (human units parsed back) and with each other."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import pytest
from test_report_summary import LLMD, MLA, VLLM, write_sample_manifest

from kvmigrate.report import render_html, render_json, render_md, render_text
from kvmigrate.report.summary import summarize
from kvmigrate.units import human_bytes, human_count, parse_bytes, parse_count

# --- parsers: one per format, each returning {table title: [row cells]} ------------------

def text_tables(text: str) -> dict[str, list[list[str]]]:
    """Sections are an UPPER-CASE title, a blank line, a header row, rows until a blank line."""
    lines = text.splitlines()
    out: dict[str, list[list[str]]] = {}
    for i, line in enumerate(lines):
        if line and line == line.upper() and re.fullmatch(r"[A-Z ]+", line) and i + 2 < len(lines) \
                and lines[i + 1] == "" and "  " in lines[i + 2].strip():
            rows = []
            for row in lines[i + 3:]:
                if not row.strip():
                    break
                rows.append(re.split(r"\s{2,}", row.strip()))
            out[line.strip().lower()] = rows
    return out


def text_pairs(text: str, section: str) -> dict[str, str]:
    lines = text.splitlines()
    start = lines.index(section.upper()) + 2
    pairs = {}
    for line in lines[start:]:
        if not line.strip():
            break
        k, v = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        pairs[k] = v
    return pairs


def md_tables(text: str) -> dict[str, list[list[str]]]:
    out: dict[str, list[list[str]]] = {}
    title = None
    rows: list[list[str]] = []
    for line in text.splitlines():
        m = re.match(r"^## (.+)$", line)
        if m:
            title, rows = m.group(1).lower(), []
            continue
        if title and line.startswith("|") and not re.match(r"^\|[-:|]+\|$", line):
            cells = [c.strip().replace("\\|", "|").strip("`").strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows.append(cells)
            out[title] = rows[1:]  # drop the header row
    return out


class _DomTables(HTMLParser):
    """Text of every <td>/<th> of each table with an id, and of the <dl> pairs."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table" and a.get("id"):
            self._table = a["id"].removeprefix("t-")
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if self._row:
                self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        self.text.append(data)


def html_tables(text: str) -> dict[str, list[list[str]]]:
    p = _DomTables()
    p.feed(text)
    return {k: v[1:] for k, v in p.tables.items()}  # drop header rows


# --- fixtures -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    path = write_sample_manifest(tmp_path_factory.mktemp("render") / "m.parquet")
    s = summarize(path)
    return {"summary": s, "json": json.loads(render_json.render(s)), "text": render_text.render(s),
            "md": render_md.render(s), "html": render_html.render(s)}


def _rows_by_namespace(rows):
    return {r[0]: r for r in rows}


TABLES = {  # text/md section title -> html table id
    "namespaces": "namespaces", "reuse": "reuse", "files by status": "status", "blocks by action": "actions",
}


def test_json_is_the_summary_with_raw_numbers(rendered):
    j = rendered["json"]
    assert j == json.loads(json.dumps(rendered["summary"]))
    assert isinstance(j["totals"]["bytes"], int)
    assert j["totals"]["bytes"] == rendered["summary"]["totals"]["bytes"]


@pytest.mark.parametrize("fmt", ["text", "md", "html"])
def test_namespace_rows_match_json(rendered, fmt):
    tables = {"text": text_tables, "md": md_tables, "html": html_tables}[fmt](rendered[fmt])
    rows = _rows_by_namespace(tables["namespaces"])
    for n in rendered["json"]["namespaces"]:
        row = rows[n["source_base"]]
        files, blocks, nbytes, alone, shared = row[4:9]
        assert parse_count(files) == pytest.approx(n["files"], rel=0.01)
        assert parse_count(blocks) == pytest.approx(n["blocks"], rel=0.01)
        assert parse_bytes(nbytes) == pytest.approx(n["bytes"], rel=0.01)
        assert parse_bytes(alone) == pytest.approx(n["bytes_alone"], rel=0.01)
        assert parse_bytes(shared) == pytest.approx(n["bytes_shared"], rel=0.01)
        assert row[1] == n["family"] and row[2] == (n["scheme"] or "-")


@pytest.mark.parametrize("fmt", ["text", "md", "html"])
def test_reuse_rows_match_json(rendered, fmt):
    tables = {"text": text_tables, "md": md_tables, "html": html_tables}[fmt](rendered[fmt])
    rows = _rows_by_namespace(tables["reuse"])
    for n in rendered["json"]["namespaces"]:
        row = rows[n["source_base"]]
        assert parse_count(row[1]) == n["reusable"]["blocks"]
        assert parse_bytes(row[2]) == pytest.approx(n["reusable"]["bytes"], rel=0.01)
        assert parse_count(row[3]) == n["pending"]["blocks"]
        assert parse_count(row[4]) == n["not_reusable"]["blocks"]
        assert parse_bytes(row[5]) == pytest.approx(n["not_reusable"]["bytes"], rel=0.01)
        assert row[7] == (n["target_base"] or "-")


@pytest.mark.parametrize("fmt", ["text", "md", "html"])
def test_status_and_action_totals_match_json(rendered, fmt):
    tables = {"text": text_tables, "md": md_tables, "html": html_tables}[fmt](rendered[fmt])
    status_rows = tables["files by status" if fmt != "html" else "status"]
    assert sorted(r[0] for r in status_rows) == sorted(rendered["json"]["totals"]["by_status"])
    for status, files, nbytes, _bits in status_rows:
        want = rendered["json"]["totals"]["by_status"][status]
        assert parse_count(files) == want["files"]
        assert parse_bytes(nbytes) == pytest.approx(want["bytes"], rel=0.01)
    action_rows = tables["blocks by action" if fmt != "html" else "actions"]
    assert sorted(r[0] for r in action_rows) == sorted(rendered["json"]["totals"]["by_action"])
    for action, blocks, nbytes in action_rows:
        want = rendered["json"]["totals"]["by_action"][action]
        assert parse_count(blocks) == want["blocks"]
        assert parse_bytes(nbytes) == pytest.approx(want["bytes"], rel=0.01)


def test_the_three_human_formats_print_identical_cells(rendered):
    text, md, html = text_tables(rendered["text"]), md_tables(rendered["md"]), html_tables(rendered["html"])
    for title, html_id in TABLES.items():
        assert text[title] == md[title] == html[html_id], title


def test_totals_agree(rendered):
    t = rendered["json"]["totals"]
    pairs = text_pairs(rendered["text"], "totals")
    assert parse_bytes(pairs["bytes"]) == pytest.approx(t["bytes"], rel=0.01)
    assert pairs["files"] == human_count(t["files"])
    assert pairs["blocks"] == human_count(t["blocks"])
    assert pairs["reusable bytes"].startswith(human_bytes(t["reusable"]["bytes"]))
    assert pairs["exit code"].startswith(str(rendered["json"]["exit_code"]))
    md = rendered["md"]
    assert f"| bytes | {human_bytes(t['bytes'])} |" in md
    assert f"| blocks | {human_count(t['blocks'])} |" in md
    dom = _DomTables()
    dom.feed(rendered["html"])
    page_text = " ".join(dom.text)
    assert human_bytes(t["bytes"]) in page_text and human_count(t["blocks"]) in page_text


def test_every_format_names_the_gate_reasons_and_target(rendered):
    reason = "not agnostic: kv kind is mla (MLA exclusion)"
    for fmt in ("text", "md", "html", "json"):
        body = rendered[fmt] if fmt != "json" else json.dumps(rendered["json"])
        assert reason in body, fmt
        for base in (VLLM, LLMD, MLA):
            assert base in body


def test_every_format_prints_each_hint_command(rendered):
    import html as html_mod

    for h in rendered["json"]["hints"]:
        assert h["command"] in rendered["text"]
        assert h["command"] in rendered["md"]
        assert html_mod.escape(h["command"]) in rendered["html"]


def test_human_units():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.50 KiB"
    assert human_bytes(5 * 1024 ** 3) == "5.00 GiB"
    assert human_bytes(1024 ** 2 - 1) == "1.00 MiB"  # rounding carries into the next unit
    assert human_count(999) == "999"
    assert human_count(20_897) == "20,897"  # exact: totals are compared across reports and the dry run
    assert human_count(1_000_000) == "1,000,000"
    assert human_count(-12_345) == "-12,345"
    for n in (0, 1, 999, 4096, 10 ** 7 + 12345, 3 * 1024 ** 4):
        assert parse_bytes(human_bytes(n)) == pytest.approx(n, rel=0.006)
        assert parse_count(human_count(n)) == n


def test_markdown_escapes_pipes_in_names(tmp_path):
    from test_report_summary import sample_metadata

    meta = sample_metadata()
    meta["namespaces"][VLLM]["target"]["reasons"] = ["a | b"]
    s = summarize(write_sample_manifest(tmp_path / "m.parquet", metadata=meta))
    md = render_md.render(s)
    assert "a \\| b" in md
    assert "| gate reason | a \\| b |" in md
