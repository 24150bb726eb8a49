"""DestTree's folder-fd cache: forgetting a folder (before it is removed) closes the
cached fds of it and of every folder below it, and no other, without going through the
whole cache."""

from __future__ import annotations

import os
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmigrate.migrate.fsops import DestTree

FOLDERS = ["a", "a/b", "a/b/c", "a/b/d", "a/e", "a/e/f", "g", "g/h", "g/h/i", "ab", "ab/c"]


def make(root) -> None:
    for d in FOLDERS:
        os.makedirs(root / d, exist_ok=True)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["open", "forget"]), st.sampled_from(FOLDERS)), max_size=40),
       max_fds=st.integers(1, 6))
def test_forget_closes_the_folder_and_what_is_below_it_only(tmp_path_factory, steps, max_fds):
    root = tmp_path_factory.mktemp("dest")
    make(root)
    with DestTree(str(root), max_fds=max_fds) as tree:
        for op, d in steps:
            before = dict(tree._fds)
            if op == "open":
                tree.dir_fd(d)
                continue
            tree.forget(d)
            gone = {k for k in before if k == d or k.startswith(d + "/")}
            assert set(tree._fds) == set(before) - gone
            for k in gone:  # closed: the fd number is no longer open (or reused by none of ours)
                assert before[k] not in tree._fds.values()
        # the index of descendants is the one the cache implies
        want: dict[str, set[str]] = {}
        for k in tree._fds:
            parts = k.split("/")
            for i in range(1, len(parts)):
                want.setdefault("/".join(parts[:i]), set()).add(k)
        assert tree._below == want
        assert len(tree._fds) <= max_fds


class _Counting(OrderedDict):
    walks = 0

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


def test_removing_a_folder_does_not_walk_the_fd_cache(tmp_path):
    """A prune removes tens of thousands of emptied folders: each removal forgets the
    folder's cached fds by its own index, not by going through every cached folder."""
    for i in range(100):
        (tmp_path / "x" / f"{i:03}").mkdir(parents=True)
    (tmp_path / "gone" / "leaf").mkdir(parents=True)
    with DestTree(str(tmp_path), max_fds=128) as tree:
        tree._fds = _Counting(tree._fds)
        for i in range(100):
            tree.dir_fd(f"x/{i:03}")
        tree.dir_fd("gone/leaf")
        _Counting.walks = 0
        tree.rmdir("gone/leaf")
        assert _Counting.walks == 0
    assert not (tmp_path / "gone" / "leaf").exists()
