"""Human units for the text, Markdown and HTML renderers (JSON keeps raw integers).

One formatter per kind of number, used by every human renderer, so the same summary
always prints the same strings; `parse_bytes` / `parse_count` invert them for tests and
for anyone reading a pasted report back. Counts are exact (`human_count`, `plural`);
bytes are binary units with three significant digits (`human_bytes`), everywhere.
"""

from __future__ import annotations

import re

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def _three_digits(value: float) -> str:
    """Three significant digits at most, no trailing zeros beyond one decimal."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def human_bytes(n: int | None) -> str:
    """1536 -> '1.50 KiB'; exact below 1 KiB."""
    if n is None:
        return "-"
    n = int(n)
    if abs(n) < 1024:
        return f"{n} B"
    value = float(abs(n))
    unit = 0
    while value >= 1024 and unit < len(_BYTE_UNITS) - 1:
        value /= 1024
        unit += 1
    text = _three_digits(value)
    if text == "1024" and unit < len(_BYTE_UNITS) - 1:  # rounding crossed a unit boundary
        text, unit = "1.00", unit + 1
    return f"{'-' if n < 0 else ''}{text} {_BYTE_UNITS[unit]}"


def human_count(n: int | None) -> str:
    """20897 -> '20,897': counts are exact (people compare totals across reports and with
    the dry run; '20.9k' hides the difference of a few blocks)."""
    if n is None:
        return "-"
    return f"{int(n):,}"


def plural(n: int | None, noun: str, nouns: str | None = None) -> str:
    """(1, 'block') -> '1 block'; (20897, 'block') -> '20,897 blocks' (the count exact)."""
    return f"{human_count(n)} {agreeing(n, noun, nouns)}"


def agreeing(n: int | None, noun: str, nouns: str | None = None) -> str:
    """The noun alone, agreeing with n (where the count is printed apart from it):
    (1, 'block') -> 'block'; (0, 'entry', 'entries') -> 'entries'."""
    return noun if n is not None and int(n) == 1 else (nouns or noun + "s")


def signed(text: str, n: int) -> str:
    """Prefix growth with '+' (diffs)."""
    return f"+{text}" if n > 0 else text


def percent(part: int, whole: int) -> str:
    if not whole:
        return "-"
    return f"{100.0 * part / whole:.1f}%"


_BYTES_RE = re.compile(r"^([+-]?\d+(?:\.\d+)?) (B|KiB|MiB|GiB|TiB|PiB|EiB)$")
_COUNT_RE = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})*$")


def parse_bytes(text: str) -> float:
    """Inverse of human_bytes (approximate above 1 KiB)."""
    m = _BYTES_RE.match(text.strip())
    if not m:
        raise ValueError(f"not a byte quantity: {text!r}")
    return float(m.group(1)) * 1024 ** _BYTE_UNITS.index(m.group(2))


def parse_count(text: str) -> int:
    """Inverse of human_count ('20,897' -> 20897)."""
    text = text.strip()
    if not _COUNT_RE.match(text):
        raise ValueError(f"not a count: {text!r}")
    return int(text.replace(",", ""))


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """Seconds of a duration or age: `45s`, `90m`, `2h`, `1h30m`, `7d`, `2w`, or a bare
    number of seconds (the one parser: --max-duration, --older-than, --quiet-period)."""
    s = str(text).strip().lower()
    try:
        return float(s)
    except ValueError:
        pass
    parts = _DURATION_PART.findall(s)
    if not parts or "".join(n + u for n, u in parts) != s:
        raise ValueError(f"not a duration: {text!r} (use e.g. 45s, 10m, 1h30m, 7d)")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
