"""The HTML report is one self-contained page, rendered by a real headless Chromium.

Chromium is a hard requirement of this test (Debian package `chromium`, installed by
.ci/run): without it the test fails and says how to install it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvmigrate.report import render_html
from kvmigrate.report.summary import summarize

from test_report_summary import AUTO, CPP, LLMD, MLA, VLLM, write_sample_manifest


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
