"""The HTML report is one self-contained page, rendered by a real headless Chromium.

Chromium is a hard requirement of this test (Debian package `chromium`, installed by
.ci/run): without it the test fails and says how to install it.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_report_summary import AUTO, CPP, LLMD, MLA, VLLM, write_sample_manifest

from kvmigrate.report import render_html
from kvmigrate.report.summary import summarize


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("headless Chromium not found: install the Debian package `chromium` "
                "(apt-get install -y chromium); .ci/run installs it in CI")


def run_chromium(tmp_path: Path, page: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", "--host-resolver-rules=MAP * ~NOTFOUND",  # no name resolves: no network
           f"--user-data-dir={profile}", *args, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> tuple[Path, dict, str]:
    d = tmp_path_factory.mktemp("html")
    s = summarize(write_sample_manifest(d / "m.parquet"))
    text = render_html.render(s)
    out = d / "report.html"
    out.write_text(text, encoding="utf-8")
    return out, s, text


def test_self_contained_no_network_no_script(page):
    _, _, text = page
    assert "<script" not in text.lower()
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", text, re.I)
    assert "http" not in text.lower()  # no URL of any kind: nothing to fetch
    assert "url(" not in text.lower() and "@import" not in text.lower()
    assert text.count("<svg") == 2


def test_charts_have_a_bar_per_namespace_and_status(page):
    _, s, text = page
    reuse = text[text.index('id="svg-reuse"'):text.index("</svg>", text.index('id="svg-reuse"'))]
    for n in s["namespaces"]:
        assert f"<title>{n['source_base']}</title>" in reuse
    assert 'class="seg-link"' in reuse and 'class="seg-concat"' in reuse and 'class="seg-replicas"' in reuse
    status = text[text.index('id="svg-status"'):]
    for st in s["totals"]["by_status"]:
        assert f'class="status-{st}"' in status


def test_headless_chromium_renders_namespaces_and_charts(page, tmp_path):
    html_path, s, _ = page
    res = run_chromium(tmp_path, html_path, "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    assert "<svg" in dom and 'id="svg-reuse"' in dom and 'id="svg-status"' in dom
    assert dom.count("<rect") >= len(s["namespaces"]) + len(s["totals"]["by_status"])
    for base in (VLLM, LLMD, MLA, CPP, AUTO):
        assert base in dom
    assert "What to do next" in dom


def test_headless_chromium_screenshot(page, tmp_path):
    html_path, _, _ = page
    shot = tmp_path / "report.png"
    res = run_chromium(tmp_path, html_path, f"--screenshot={shot}", "--window-size=1280,2000",
                       "--hide-scrollbars")
    assert res.returncode == 0, res.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1280, 2000)
    assert len(data) > 20_000  # a blank page compresses to a few KiB; charts and tables do not


def test_html_escapes_names(tmp_path):
    from test_report_summary import sample_metadata

    meta = sample_metadata()
    meta["namespaces"][VLLM]["target"]["reasons"] = ["<b>not agnostic</b> & more"]
    text = render_html.render(summarize(write_sample_manifest(tmp_path / "m.parquet", metadata=meta)))
    assert "&lt;b&gt;not agnostic&lt;/b&gt; &amp; more" in text
    assert "<b>not agnostic" not in text


# --- fits a screen (1400 px and 800 px) -------------------------------------------------

# Injected into a copy of the page (the report itself has no script): the document's and
# each table container's widths, and the on-screen width of every bytes-by-status bar.
PROBE = """<script>
const box = e => e.getBoundingClientRect();
const r = {scrollWidth: document.documentElement.scrollWidth, innerWidth: window.innerWidth,
  bars: Object.fromEntries([...document.querySelectorAll('#svg-status rect')].map(
    e => [e.getAttribute('class').replace('status-', ''), box(e).width])),
  tables: Object.fromEntries([...document.querySelectorAll('.scroll')].map(
    e => [e.firstElementChild.id, [e.scrollWidth, e.clientWidth]]))};
const p = document.createElement('pre'); p.id = 'probe'; p.textContent = JSON.stringify(r);
document.body.appendChild(p);
</script>"""


def measure(tmp_path: Path, html_text: str, width: int) -> dict:
    import json

    probe = tmp_path / f"probe-{width}.html"
    probe.write_text(html_text.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    res = run_chromium(tmp_path, probe, f"--window-size={width},1000", "--virtual-time-budget=5000", "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    m = re.search(r'<pre id="probe">(.*?)</pre>', res.stdout, re.S)
    assert m, res.stdout[-2000:]
    return json.loads(html.unescape(m.group(1)))


@pytest.fixture(scope="module")
def synth_page(tmp_path_factory) -> tuple[Path, dict, str]:
    """The HTML report of a scanned synth tree: four families, defects, a refused target."""
    from kvmigrate.synth import SynthSpec, build

    from helpers import SMALL
    from helpers.cli_helpers import run

    d = tmp_path_factory.mktemp("html-synth")
    root = d / "root"
    root.mkdir()
    for spec in ({"family": "vllm", "scheme": "S2", "tp": 2, "defects": ("tmp_vllm",)},
                 {"family": "llmd", "tp": 2, "seed": 2, "defects": ("missing_rank",)},
                 {"family": "llmd", "tp": 4, "kv_kind": "mla", "seed": 4, "model_name": "org/deep-mla"},
                 {"family": "vllmcpp", "seed": 3, "defects": ("zero_filled", "header_magic")}):
        build(root, SynthSpec(**{**SMALL, **spec}))
    m, out = d / "m.parquet", d / "report.html"
    run("scan", root, "--verify", "hash", "-o", m, "-q")
    code, text = run("report", m, "--format", "html", "-o", out)
    assert code & 1, text
    return out, summarize(m), out.read_text(encoding="utf-8")


@pytest.mark.parametrize("which", ["sample", "synth"])
@pytest.mark.parametrize("width", [1400, 800])
def test_no_horizontal_overflow(which, width, page, synth_page, tmp_path):
    html_path, _, text = page if which == "sample" else synth_page
    shot = tmp_path / f"report-{width}.png"
    res = run_chromium(tmp_path, html_path, f"--screenshot={shot}", f"--window-size={width},1600")
    assert res.returncode == 0, res.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(data[16:20], "big") == width
    got = measure(tmp_path, text, width)
    assert got["scrollWidth"] <= got["innerWidth"], f"the page is {got['scrollWidth']} px wide at {width} px"
    if width == 1400:  # the Target and Finding columns are on screen, not behind a scroll bar
        for table in ("t-reuse", "t-findings"):
            scroll, client = got["tables"][table]
            assert scroll <= client, f"{table} is {scroll} px wide in a {client} px column"


@pytest.mark.parametrize("which", ["sample", "synth"])
@pytest.mark.parametrize("width", [1400, 800])
def test_every_status_has_a_visible_bar(which, width, page, synth_page, tmp_path):
    _, s, text = page if which == "sample" else synth_page
    got = measure(tmp_path, text, width)
    assert len(s["totals"]["by_status"]) >= 4  # healthy blocks and several defects side by side
    for status in s["totals"]["by_status"]:
        assert got["bars"].get(status, 0) >= 2, f"status {status}: bar {got['bars'].get(status)} px at {width} px"


def test_tiles_say_findings_and_exit_code_apart(page):
    _, s, text = page
    tiles = text[text.index('<section class="tiles">'):text.index("</section>", text.index('class="tiles"'))]
    problems = [f for f in s["findings"] if f["severity"] != "note"]
    notes = len(s["findings"]) - len(problems)
    assert s["exit_code"] == 5 and len(problems) == 9
    assert '<div class="v">9</div><div class="l">findings to act on (3 integrity problems, 6 other findings)' \
           f", {notes} notes</div>" in tiles
    assert '<div class="v">exit 5</div><div class="l">exit code = 1 findings + 4 integrity</div>' in tiles
    assert "findings · exit" not in tiles


def test_tiles_count_each_severity_with_its_noun(page):
    # it said "(1 integrity, 7 finding)": each severity's count agrees with its noun
    _, s, _ = page
    one_each = [next(f for f in s["findings"] if f["severity"] == sev) for sev in ("integrity", "finding")]
    text = render_html.render({**s, "findings": one_each})
    assert '<div class="v">2</div><div class="l">findings to act on (1 integrity problem, 1 other finding)</div>' \
           in text


def test_repeated_notes_are_folded_under_the_findings(page):
    _, s, text = page
    findings = text[text.index('<section id="findings">'):text.index("</section>", text.index('id="findings"'))]
    table = findings[:findings.index("<details")]
    assert "assumed_facts" not in table and 'class="sev" style="background:#78909c"' not in table
    notes = findings[findings.index('<details class="notes">'):]
    assert "<details class=\"notes\" open" not in findings  # closed: the real findings come first
    assumed = [f for f in s["findings"] if f["code"] == "assumed_facts"]
    assert len(assumed) == 2 and len({f["message"] for f in assumed}) == 2
    assert "assumed_facts ×2" in notes
    for f in s["findings"]:
        if f["severity"] == "note":
            assert html.escape(f["message"], quote=True) in notes
