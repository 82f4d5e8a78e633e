"""The package's layers are its top-level folders, and this module reads its imports from the
source text (function-level and type-only ones included, relative ones resolved): the import
graph between modules, and between top-level folders with the number of import lines along
each arrow. ``python -m mostovik_pipelines_tests.support.layers`` prints the folders' graph
(``--no-counts``: its arrows only, the picture ``docs/architecture.md`` shows), and
``rules/test_layering.py`` checks both."""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

import mostovik_pipelines

PACKAGE = Path(mostovik_pipelines.__file__).parent

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("the warehouse's tables", ("warehouse",)),
    ("vocabulary", ("core",)),
    ("a run's life on a deployment", ("platform",)),
    ("I/O", ("resources",)),
    ("the machinery every source shares", ("framework",)),
    ("sources and the services beside them",
     ("standin", "sources", "maintenance", "metrics", "scaffold")),
    ("what assembles and starts it all", ("definitions.py", "operator", "cli.py", "__init__.py")),
)
"""The layers, lowest first, each a set of top-level folders (and the package's three top-level
modules): the warehouse's tables and types (they import nothing of ours); the names every layer
speaks (errors and their classification, the outage budgets, retry policies, run tags, settings,
the load target, the one module of private Dagster names); a run's life on a deployment (its
claims, the fence every store checks before it writes, its status, the tracker, recovery, the
executor, the instance's storage); every piece of I/O; the machinery every source shares; the
sources and the services beside them; what assembles and starts it all. A folder imports its own
layer or those below, and no two folders import each other, even through others."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))
            if "templates" not in path.parts and "migrations" not in path.parts}


def import_statements(name: str, path: Path, known: set[str]) -> list[set[str]]:
    """The package's modules each import statement of ``name`` names, relative imports
    resolved (``from a import b`` names ``a.b`` when that is a module, else ``a``)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    statements = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named = {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *filter(None, [base])])
            named = {base, *(f"{base}.{alias.name}" for alias in node.names)}
        else:
            continue
        found = {module for module in named if module in known and module != name}
        if found:
            statements.append(found)
    return statements


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = package_modules()
    known = set(modules)
    return {name: set().union(*import_statements(name, path, known))
            for name, path in modules.items()}


def folder_of(module: str) -> str:
    """The top-level folder a module lives in (or ``cli.py``, ``definitions.py``,
    ``__init__.py`` for the package's own modules)."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    if (PACKAGE / parts[0]).is_dir():
        return parts[0]
    return f"{parts[0]}.py"


def folder_imports() -> Counter[tuple[str, str]]:
    """(folder, imported folder) -> the number of import lines from one to the other."""
    modules = package_modules()
    known = set(modules)
    counts: Counter[tuple[str, str]] = Counter()
    for name, path in modules.items():
        source = folder_of(name)
        for statement in import_statements(name, path, known):
            for target in {folder_of(module) for module in statement} - {source}:
                counts[source, target] += 1
    return counts


def top_level_folders() -> list[str]:
    return sorted(path.name for path in PACKAGE.iterdir()
                  if (path.is_dir() and (path / "__init__.py").exists())
                  or (path.suffix == ".py"))


def layer_of(folder: str) -> int | None:
    return next((index for index, (_, folders) in enumerate(LAYERS) if folder in folders), None)


def upward_imports(edges: set[tuple[str, str]] | Counter[tuple[str, str]]) -> list[str]:
    return sorted(f"{source} ({LAYERS[layer_of(source)][0]}) imports {target} "
                  f"({LAYERS[layer_of(target)][0]})"
                  for source, target in edges if layer_of(target) > layer_of(source))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The sets of nodes that import each other, directly or through others (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for imported in sorted(graph.get(node, ())):
            if imported not in index:
                visit(imported)
                low[node] = min(low[node], low[imported])
            elif imported in stack:
                low[node] = min(low[node], index[imported])
        if low[node] == index[node]:
            members = []
            while not members or members[-1] != node:
                members.append(stack.pop())
            if len(members) > 1:
                cycles.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def folder_graph(counts: Counter[tuple[str, str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for source, target in counts:
        graph.setdefault(source, set()).add(target)
    return graph


def render(counts: Counter[tuple[str, str]] | None = None, *, with_counts: bool = True) -> str:
    """The layers from the top down, each folder with its arrows to the folders it imports
    (import lines in brackets), lowest layer first among the targets. Without the counts, it is
    the picture ``docs/architecture.md`` shows: it changes only when an arrow does."""
    counts = folder_imports() if counts is None else counts
    lines = []
    for number, (title, folders) in reversed(list(enumerate(LAYERS, start=1))):
        lines.append(f"{number} {title}")
        for folder in folders:
            targets = sorted((target for source, target in counts if source == folder),
                             key=lambda target: (layer_of(target), target))
            arrows = ", ".join(f"{target} ({counts[folder, target]})" if with_counts else target
                               for target in targets)
            lines.append(f"    {folder}" + (f" -> {arrows}" if arrows else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(with_counts="--no-counts" not in sys.argv[1:]))
