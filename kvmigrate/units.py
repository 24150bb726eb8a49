"""Human units for the text, Markdown and HTML renderers (JSON keeps raw integers).

One formatter per kind of number, used by every human renderer, so the same summary
always prints the same strings; `parse_bytes` / `parse_count` invert them for tests and
for anyone reading a pasted report back.
"""

from __future__ import annotations

import re

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
_COUNT_UNITS = ("", "k", "M", "G", "T")


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
    """12345 -> '12.3k'; exact below 10 000 (small counts are read, not estimated)."""
    if n is None:
        return "-"
    n = int(n)
    if abs(n) < 10_000:
        return str(n)
    value = float(abs(n))
    unit = 0
    while value >= 1000 and unit < len(_COUNT_UNITS) - 1:
        value /= 1000
        unit += 1
    text = _three_digits(value)
    if text == "1000" and unit < len(_COUNT_UNITS) - 1:
        text, unit = "1.00", unit + 1
    return f"{'-' if n < 0 else ''}{text}{_COUNT_UNITS[unit]}"


def signed(text: str, n: int) -> str:
    """Prefix growth with '+' (diffs)."""
    return f"+{text}" if n > 0 else text


def percent(part: int, whole: int) -> str:
    if not whole:
        return "-"
    return f"{100.0 * part / whole:.1f}%"


_BYTES_RE = re.compile(r"^([+-]?\d+(?:\.\d+)?) (B|KiB|MiB|GiB|TiB|PiB|EiB)$")
_COUNT_RE = re.compile(r"^([+-]?\d+(?:\.\d+)?)(k|M|G|T)?$")


def parse_bytes(text: str) -> float:
    """Inverse of human_bytes (approximate above 1 KiB)."""
    m = _BYTES_RE.match(text.strip())
    if not m:
        raise ValueError(f"not a byte quantity: {text!r}")
    return float(m.group(1)) * 1024 ** _BYTE_UNITS.index(m.group(2))


def parse_count(text: str) -> float:
    """Inverse of human_count (approximate at 10 000 and above)."""
    m = _COUNT_RE.match(text.strip())
    if not m:
        raise ValueError(f"not a count: {text!r}")
    return float(m.group(1)) * 1000 ** _COUNT_UNITS.index(m.group(2) or "")


_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d|w)?$")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """Seconds of an age like `90s`, `10m`, `1h`, `7d`, `2w` (a bare number: seconds)."""
    m = _DURATION_RE.match(text.strip())
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 10m, 1h, 7d)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2) or "s"]
