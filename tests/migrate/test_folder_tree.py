"""prune's folder removal order (quarantine.FolderTree): every folder of the files moved,
with its parents, deepest first and by path descending, as the sorted list of paths it
replaced, whatever the names (`-` and `.` sort before `/`, so a name's prefix does not
decide)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvmigrate.migrate.quarantine import FolderTree

NAMES = st.text(alphabet="ab-._/0", min_size=1, max_size=4).filter(lambda s: "/" not in s)
PATHS = st.lists(st.lists(NAMES, min_size=1, max_size=4).map("/".join), max_size=30)


def _sorted_paths(parents: list[str]) -> list[str]:
    folders = {"/".join(p.split("/")[:k]) for p in parents for k in range(1, p.count("/") + 2) if p}
    return sorted(folders, key=lambda d: (d.count("/"), d), reverse=True)


@given(PATHS)
def test_deepest_first_is_the_paths_sorted_order(parents):
    assert list(FolderTree(parents).deepest_first()) == _sorted_paths(parents)


def test_a_name_that_sorts_before_the_slash():
    parents = ["m/x", "m-2/y", "m/x-1", "m.b/z", "m"]
    assert list(FolderTree(parents).deepest_first()) == _sorted_paths(parents)
