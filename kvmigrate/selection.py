"""`--only PATTERN` / `--exclude PATTERN`: which namespaces a run works on (interface.md §5).

A namespace is known by three names: its model name, its source base folder name and its
target base folder name. A pattern is a glob (fnmatch, case-sensitive) matched against
each of them; `/` in a pattern also matches the `_` that stands for it in folder names.
A namespace is selected when some --only pattern matches one of its names (or no --only
is given) and no --exclude pattern matches any of them.

The scan decides from the folder name first (`by_folder`), so an excluded namespace is
never read: only a namespace whose target name could still decide is read up to its
config.json (the target is computed from it), never its blocks.
"""

from __future__ import annotations

import fnmatch
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvmigrate import layout

HEX = "0123456789abcdef"
D12_LEN = 12


@dataclass(frozen=True)
class Selection:
    only: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    # source namespaces (base names) a run leaves out although the patterns select them:
    # `migrate --apply` never places blocks into a guessed target (not a pattern: never printed)
    left_out: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.only or self.exclude or self.left_out)

    def admits(self, names: Iterable[str | None]) -> bool:
        """Selected, given every name the namespace is known by."""
        known = [n for n in names if n]
        if any(_matches(p, n) for p in self.exclude for n in known):
            return False
        return not self.only or any(_matches(p, n) for p in self.only for n in known)

    def admits_namespace(self, base: str, meta: dict[str, Any]) -> bool:
        """Selected, for a namespace of a manifest's metadata (its names are all known)."""
        return self.admits(namespace_names(base, meta))

    def by_folder(self, base: str) -> bool | None:
        """The decision from the base folder name alone: True or False when no other name
        can change it, None when the target base name (not known yet) still could."""
        parsed = layout.parse_folder(base)
        names = [base] + ([parsed.safe_model] if parsed is not None else [])
        if any(_matches(p, n) for p in self.exclude for n in names):
            return False
        safe_model = parsed.safe_model if parsed is not None else None

        def target_may_match(patterns: tuple[str, ...]) -> bool:
            return safe_model is not None and any(_could_match_base(p, safe_model) for p in patterns)

        if self.only and not any(_matches(p, n) for p in self.only for n in names):
            return None if target_may_match(self.only) else False
        return None if target_may_match(self.exclude) else True

    def metadata(self) -> dict[str, list[str]]:
        return {"only": list(self.only), "exclude": list(self.exclude)}

    def args(self) -> list[str]:
        """The selection as command-line arguments, e.g. ["--only", "Qwen/*"] (for hints)."""
        return [a for p in self.only for a in ("--only", p)] + [a for p in self.exclude for a in ("--exclude", p)]

    def flags(self) -> str:
        """`args()` quoted for a shell: `--only 'Qwen/*' --exclude x`."""
        return " ".join(shlex.quote(a) for a in self.args())

    @classmethod
    def of(cls, only: Iterable[str] = (), exclude: Iterable[str] = ()) -> Selection:
        return cls(tuple(only or ()), tuple(exclude or ()))


def namespace_names(base: str, meta: dict[str, Any]) -> list[str | None]:
    """Model name, source base and target base of a namespace's manifest metadata."""
    parsed = layout.parse_folder(base)
    return [meta.get("model_name"), parsed.safe_model if parsed is not None else None, base,
            (meta.get("target") or {}).get("base_name")]


def selected_bases(namespaces: dict[str, dict[str, Any]], selection: Selection) -> set[str]:
    """The selected source bases of a manifest's metadata, widened to whole deployments:
    a vllm.cpp deployment (one namespace per rank) is migrated or skipped as one."""
    chosen = {b for b, m in namespaces.items() if selection.admits_namespace(b, m)}
    deployments = {namespaces[b].get("deployment") for b in chosen} - {None}
    return (chosen | {b for b, m in namespaces.items() if m.get("deployment") in deployments}) - set(selection.left_out)


def _matches(pattern: str, name: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or ("/" in pattern
                                                  and fnmatch.fnmatchcase(name, pattern.replace("/", "_")))


def _could_match_base(pattern: str, safe_model: str) -> bool:
    """Whether the glob can match `<safe_model>_<12 hex digits>` for some digits: the
    target base folder of a namespace of this model, whatever its digest."""
    positions = [{c} for c in safe_model + "_"] + [set(HEX)] * D12_LEN
    return any(_glob_fits(_tokens(p), positions) for p in {pattern, pattern.replace("/", "_")})


def _tokens(pattern: str) -> list[str]:
    """A glob split into tokens: `*`, `?`, a `[...]` set or one literal character."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        if pattern[i] == "[":
            j = i + 1
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j < n:
                out.append(pattern[i:j + 1])
                i = j + 1
                continue
        out.append(pattern[i])
        i += 1
    return out


def _glob_fits(tokens: list[str], positions: list[set[str]]) -> bool:
    """Glob matching over positions that may each be any of a set of characters: the
    token indexes reachable after each position (a `*` may match nothing, so it is skipped
    over as well as kept)."""
    def past_stars(states: set[int]) -> set[int]:
        out = set(states)
        for k in states:
            while k < len(tokens) and tokens[k] == "*":
                k += 1
                out.add(k)
        return out

    reach = past_stars({0})
    for chars in positions:
        step = set()
        for k in reach:
            if k < len(tokens) and (tokens[k] == "*" or any(fnmatch.fnmatchcase(c, tokens[k]) for c in chars)):
                step.add(k if tokens[k] == "*" else k + 1)
        reach = past_stars(step)
        if not reach:
            return False
    return len(tokens) in reach


def journal_bases(targets: dict[str, dict[str, Any]], selection: Selection) -> set[str]:
    """The target bases of a journal's `target` records that a selection keeps: a target
    is known by its base, its sources' bases and the model name in them (or in the
    record: a flat family's)."""
    def names(base: str, rec: dict[str, Any]) -> list[str | None]:
        bases = [base, *(rec.get("sources") or ())]
        # (a flat family's target has no folder to read the model from: its record names it)
        return bases + [p.safe_model for p in map(layout.parse_folder, bases) if p is not None] + [rec.get("model_name")]

    return {b for b, rec in targets.items() if selection.admits(names(b, rec))}


def base_of_path(relpath: str) -> str | None:
    """The namespace (base folder name) a path under the root belongs to, or None."""
    folder = layout.parse_folder(relpath.split("/", 1)[0])
    return folder.base if folder is not None else None
