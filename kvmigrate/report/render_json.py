"""JSON report: the summary itself, raw integers, stable sorted keys (scripts read this)."""

from __future__ import annotations

import json
from typing import Any


def render(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n"


def render_diff(d: dict[str, Any]) -> str:
    return json.dumps(d, indent=2, sort_keys=True, default=str) + "\n"
