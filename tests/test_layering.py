"""Stages never import each other (issue 17): scan, migrate and report meet in
kvmigrate.pipeline, which the CLI and scale-out call.

Every import of every kvmigrate module is read with `ast`, including the ones inside
function bodies (a lazy import is a dependency too). The stage rule: scan imports no
migrate or report module, migrate no scan or report module, report no scan or migrate
module; the layers below the stages (layout, classify, manifest, identity, transforms,
...) import no stage at all. Only the pipeline, the CLI and scale-out compose stages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvmigrate

PACKAGE = Path(kvmigrate.__file__).parent
STAGES = ("scan", "migrate", "report")
COMPOSERS = ("pipeline", "cli", "scaleout", "__main__")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported kvmigrate module) for every import statement in the file; `from
    kvmigrate import scan` counts as an import of kvmigrate.scan."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{a.name}") for a in node.names]  # a submodule, if it is one
    return [(line, m) for line, m in found if m == "kvmigrate" or m.startswith("kvmigrate.")]


def _layer(module: str) -> str | None:
    """The stage or composer a module belongs to, "lower" for the layers below, None for
    a name that is no module of its own (e.g. a function imported with from ... import)."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    top = parts[1]
    if top in STAGES or top in COMPOSERS:
        return top
    return "lower"


def _is_module(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def test_stages_never_import_each_other():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _module_name(path)
        own = _layer(importer) or "lower"
        if own in COMPOSERS:
            continue
        for line, module in _imports(path):
            if not _is_module(module):
                continue
            theirs = _layer(module)
            if theirs in (None, own, "lower"):
                continue
            violations.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {own} layer imports {module}")
    assert violations == [], "\n".join(violations)


def test_scale_out_uses_public_hooks_of_stage_classes():
    """A composer (scale-out, the pipeline, the CLI) configures a stage's classes through
    their public arguments (e.g. Applier(take_locks=False, place_blocks=...)), never by
    subclassing one and overriding its private methods."""
    overrides = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _layer(_module_name(path)) not in COMPOSERS:
            continue
        tree = ast.parse(path.read_text(), str(path))
        from_stages = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                       and node.module and _layer(node.module) in STAGES for a in node.names}
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            bases = {b.id for b in cls.bases if isinstance(b, ast.Name)} & from_stages
            for fn in cls.body:
                if bases and isinstance(fn, ast.FunctionDef) and fn.name.startswith("_") \
                        and not fn.name.startswith("__"):
                    overrides.append(f"{path.relative_to(PACKAGE.parent)}:{fn.lineno}: {cls.name}({', '.join(bases)})"
                                     f".{fn.name}")
    assert overrides == [], "\n".join(overrides)


def _module_graph() -> dict[str, set[str]]:
    """Every kvmigrate module -> the kvmigrate modules it imports (lazy imports too)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _module_name(path)
        graph[importer] = {m for _, m in _imports(path) if _is_module(m) and m != importer
                           and not importer.startswith(m + ".")}  # a package's own __init__ is no cycle
    return graph


def test_no_module_imports_itself_back():
    """No import cycle between modules, lazy imports included: a cycle hidden in a function
    body (`from ... import x  # they import this module`) is two modules that are one, or a
    layer below calling one above (pipeline <-> scale-out, summary <-> hints, the synth
    tree <-> its defects were three)."""
    graph = _module_graph()
    cycles = []
    for start in graph:
        stack, seen = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    cycles.append(" -> ".join(path + (start,)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + (nxt,)))
    assert cycles == [], "\n".join(sorted(set(cycles)))
