"""reports/ holds what a reader needs: each named run's report and its figures, no tree
listings or logs of megabytes, and every path the README, docs/ and the reports quote into
it is there."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REPORTS = REPO / "reports"
MAX_BYTES = 1 << 20  # a report is read; a bigger file is a listing or a log that belongs elsewhere


def test_no_file_under_reports_is_over_1_mib():
    big = [f"{p.relative_to(REPO)} ({p.stat().st_size:,} bytes)" for p in sorted(REPORTS.rglob("*"))
           if p.is_file() and p.stat().st_size > MAX_BYTES]
    assert not big, big


def quoted_paths(md: Path) -> list[str]:
    """Where `md` points: its Markdown links (relative to its folder) and the repository
    paths it names under reports/ (relative to the repository), as paths from the repo."""
    text = md.read_text()
    out = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1).split("#")[0]
        if target and not re.match(r"[a-z]+:", target):  # not http:, mailto: ...
            out.append(str((md.parent / target).resolve().relative_to(REPO)))
    for m in re.finditer(r"`(\.\./[^`\s]*)`", text):  # `../other-run/` in a run's README
        out.append(str((md.parent / m.group(1)).resolve().relative_to(REPO)))
    # a whole token (not part of /work/x/reports/... nor a glob such as reports/run-s*)
    out += re.findall(r"(?<![\w/.-])reports/[\w./-]*[\w/](?![\w.*/-])", text)
    return out


def test_every_path_quoted_into_reports_resolves():
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPORTS.rglob("*.md"))]
    missing = [f"{md.relative_to(REPO)}: {p}" for md in docs for p in quoted_paths(md)
               if p.startswith("reports") and not (REPO / p).exists()]
    assert not missing, missing


def test_a_named_run_s_report_links_the_shared_reports_from_its_folder():
    """BENCHMARKS.md quotes TRANSFORMS.md (and BASELINE.md) of reports/: a run written into
    reports/NAME/ links them as ../, one in reports/ itself or outside the repo as they are."""
    import json

    import kvbench  # scripts/kvbench

    result = json.loads((REPORTS / "safe-apply" / "benchmarks.json").read_text())
    assert "](../TRANSFORMS.md)" in kvbench.render(result, REPORTS / "safe-apply")
    for out in (REPORTS, Path("/tmp/elsewhere"), None):
        text = kvbench.render(result, out)
        assert "](TRANSFORMS.md)" in text and "](../TRANSFORMS.md)" not in text
