"""Release numbers of the writers' software (PEP 440 strings such as `0.3.13.post1`,
`0.5.7rc2`), compared as tuples: one parser for every family's release facts."""

from __future__ import annotations

import re

_NUMBERS = re.compile(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?")


def release_tuple(release: object) -> tuple[int, int, int] | None:
    """A release's first three numbers (`0.3.13.post1` -> (0, 3, 13), `0.5.7rc2` -> (0, 5, 7),
    a missing one 0); a list of releases (a comma list of a flag): the oldest; None when
    there is no number."""
    if isinstance(release, (list, tuple)):
        parts = [p for p in (release_tuple(r) for r in release) if p is not None]
        return min(parts) if parts else None
    m = _NUMBERS.search(str(release or ""))
    if m is None:
        return None
    a, b, c = (int(x or 0) for x in m.groups())
    return a, b, c
