"""The layout's rules, read from the source text, function-level and type-only imports included:
the layers go one way (a module imports its own layer or those below, never above), no two
modules import each other even through others, the framework imports no source, and a
declaration (a source's ``source.py``, and the framework's vocabulary for it) imports neither the
loader nor the steps, so declaring a source never pulls in what only a run needs."""

from __future__ import annotations

import ast
from pathlib import Path

import mostovik_pipelines

PACKAGE = Path(mostovik_pipelines.__file__).parent
SHARED = ("framework", "maintenance", "resources", "warehouse", "standin", "scaffold")
RUN_ONLY = ("mostovik_pipelines.framework.load", "mostovik_pipelines.framework.steps",
            "mostovik_pipelines.framework.readers")


LAYERS = (
    ("vocabulary", ("settings", "warehouse", "framework.errors", "framework.outages",
                    "framework.retries", "framework.dagster_compat", "framework.runs.tags",
                    "framework.load_target")),
    ("resources", ("resources", "instance_storage", "framework.runs.claims")),
    ("framework", ("framework", "execution")),
    ("sources and services", ("sources", "maintenance", "standin", "scaffold", "metrics")),
    ("entry points", ("definitions", "cli", "operator", "demo", "local_runs", "")),
)
"""The layers, lowest first, by module prefix under ``mostovik_pipelines`` (the longest prefix
decides): the names every layer uses (settings, errors, retries, tags, the warehouse's tables);
every piece of I/O (the run's claim among them: a session of its own on run storage, which the
stores check before they write); the machinery every source shares (and the executor that runs
its steps); the sources and the services beside them; what assembles and starts it all."""


def imports(path: Path, *, module_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def modules_under(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (PACKAGE / folder).rglob("*.py"))


def test_the_shared_code_imports_no_source():
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(name for name in imports(path)
                                               if name.startswith("mostovik_pipelines.sources"))
        for path in modules_under(*SHARED)
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_declarations_import_no_loader_and_no_step():
    declarations = [PACKAGE / "framework" / "spec.py", PACKAGE / "framework" / "load_target.py",
                    *sorted(PACKAGE.glob("sources/*/source.py"))]
    assert len(declarations) >= 6
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            name for name in imports(path, module_level_only=True)
            if any(name == run_only or name.startswith(f"{run_only}.") for run_only in RUN_ONLY))
        for path in declarations
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))
            if "templates" not in path.parts and "migrations" not in path.parts}


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *filter(None, [base])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {module for module in found if module in known and module != name}


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def layer_of(module: str) -> int | None:
    inner = module.removeprefix("mostovik_pipelines").removeprefix(".")
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS)
               for prefix in prefixes
               if inner == prefix or (prefix and inner.startswith(f"{prefix}."))]
    return max(matches)[1] if matches else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} ({LAYERS[layer_of(module)][0]}) imports {imported} "
                  f"({LAYERS[layer_of(imported)][0]})"
                  for module, imported_set in graph.items() for imported in imported_set
                  if layer_of(imported) > layer_of(module))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The sets of modules that import each other, directly or through others (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            members = []
            while not members or members[-1] != module:
                members.append(stack.pop())
            if len(members) > 1:
                cycles.append(sorted(members))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_every_module_has_a_layer():
    assert [module for module in package_modules() if layer_of(module) is None] == []


def test_the_layers_go_one_way():
    assert upward_imports(import_graph()) == []


def test_no_modules_import_each_other():
    assert import_cycles(import_graph()) == []


def test_the_checks_see_an_upward_import_and_a_cycle():
    graph = {"mostovik_pipelines.settings": {"mostovik_pipelines.cli"},
             "mostovik_pipelines.cli": {"mostovik_pipelines.settings"}}
    assert upward_imports(graph) == [
        "mostovik_pipelines.settings (vocabulary) imports mostovik_pipelines.cli (entry points)"]
    assert import_cycles(graph) == [["mostovik_pipelines.cli", "mostovik_pipelines.settings"]]
