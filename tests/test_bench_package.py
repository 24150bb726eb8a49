"""scripts/kvbench, the bench's package: its modules import one another without a cycle
(bench.py and bench_compare.py once imported each other), none grows past 800 lines, and
scripts/bench.py stays a thin command line over it."""

import ast
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
PACKAGE = SCRIPTS / "kvbench"
MAX_LINES = 800


def imports_of(path: Path) -> set[str]:
    """The kvbench modules `path` imports (relative or absolute), by module name."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1 or base == "kvbench" or base.startswith("kvbench."):
                base = base.removeprefix("kvbench").lstrip(".")
                if base:
                    out.add(base.split(".")[0])
                else:  # from . import x
                    out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("kvbench."))
    return out


def test_the_bench_modules_import_without_a_cycle():
    graph = {p.stem: imports_of(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert {"harness", "cli"} <= set(graph)
    done: set[str] = set()

    def visit(mod: str, path: tuple[str, ...]) -> None:
        assert mod not in path, " -> ".join((*path, mod))
        if mod in done:
            return
        for dep in sorted(graph.get(mod, ())):
            visit(dep, (*path, mod))
        done.add(mod)

    for mod in sorted(graph):
        visit(mod, ())


def test_no_bench_file_over_800_lines():
    files = [SCRIPTS / "bench.py", *sorted(PACKAGE.glob("*.py"))]
    long = {f.name: n for f in files if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, long
