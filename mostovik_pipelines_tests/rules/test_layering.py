"""The layout's rules, read from the source text, function-level and type-only imports included
(:mod:`mostovik_pipelines_tests.support.layers`): the layers are the package's top-level
folders, and they go one way (a folder imports its own layer or those below, never above); no
two folders import each other, nor two modules, even through others; the shared code imports no
source; a declaration (a source's ``source.py``, and the framework's vocabulary for it) imports
neither the loader nor the steps, so declaring a source never pulls in what only a run needs;
and ``docs/architecture.md`` shows the graph's arrows as ``python -m
mostovik_pipelines_tests.support.layers --no-counts`` prints them."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

from mostovik_pipelines_tests.support.layers import (
    LAYERS,
    PACKAGE,
    folder_graph,
    folder_imports,
    folder_of,
    import_cycles,
    import_graph,
    layer_of,
    render,
    top_level_folders,
    upward_imports,
)

SHARED = ("core", "platform", "resources", "framework", "maintenance", "warehouse", "standin",
          "scaffold")
RUN_ONLY = ("mostovik_pipelines.framework.load", "mostovik_pipelines.framework.steps",
            "mostovik_pipelines.framework.readers")
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


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
    declarations = [PACKAGE / "framework" / "spec.py", PACKAGE / "core" / "load_target.py",
                    *sorted(PACKAGE.glob("sources/*/source.py"))]
    assert len(declarations) >= 6
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            name for name in imports(path, module_level_only=True)
            if any(name == run_only or name.startswith(f"{run_only}.") for run_only in RUN_ONLY))
        for path in declarations
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_every_top_level_folder_has_a_layer_and_every_layer_its_folders():
    named = [folder for _, folders in LAYERS for folder in folders]
    assert sorted(named) == top_level_folders()
    assert len(named) == len(set(named))


def test_the_package_has_no_loose_module_but_its_entry_points():
    assert [name for name in top_level_folders() if name.endswith(".py")] == [
        "__init__.py", "cli.py", "definitions.py"]


def test_the_layers_go_one_way():
    upward = {(folder_of(module), folder_of(imported))
              for module, imported_set in import_graph().items() for imported in imported_set}
    offenders = sorted(
        f"{module} imports {imported}"
        for module, imported_set in import_graph().items() for imported in imported_set
        if layer_of(folder_of(imported)) > layer_of(folder_of(module)))
    assert (upward_imports(upward), offenders) == ([], [])


def test_no_folders_import_each_other():
    assert import_cycles(folder_graph(folder_imports())) == []


def test_no_modules_import_each_other():
    assert import_cycles(import_graph()) == []


def test_resources_import_neither_the_framework_nor_anything_above_it():
    counts = folder_imports()
    assert sorted(target for source, target in counts
                  if source == "resources" and layer_of(target) >= layer_of("framework")) == []


def test_the_checks_see_an_upward_import_and_a_cycle():
    edges = Counter({("core", "cli.py"): 1, ("cli.py", "core"): 2})
    assert upward_imports(edges) == [
        "core (vocabulary) imports cli.py (what assembles and starts it all)"]
    assert import_cycles(folder_graph(edges)) == [["cli.py", "core"]]


def test_the_architecture_document_shows_the_printed_graph():
    blocks = re.findall(r"```text\n(.*?)\n```", ARCHITECTURE.read_text("utf-8"), re.DOTALL)
    picture = render(with_counts=False)
    assert picture in blocks, (
        "docs/architecture.md's layer picture differs from the import graph; paste the output of "
        "`python -m mostovik_pipelines_tests.support.layers --no-counts` there:\n" + picture)


def private_dagster_names(path: Path) -> list[str]:
    """What ``path`` imports from a private part of Dagster's packages: a module or a name
    whose dotted path has a part starting with an underscore."""
    return sorted(name for name in imports(path)
                  if name.split(".")[0].startswith("dagster")
                  and any(part.startswith("_") for part in name.split(".")))


def test_private_dagster_names_are_imported_only_by_the_compatibility_module():
    compat = PACKAGE / "core" / "dagster_compat.py"
    assert private_dagster_names(compat)
    offenders = {str(path.relative_to(PACKAGE)): private_dagster_names(path)
                 for path in sorted(PACKAGE.rglob("*.py")) if path != compat}
    assert {path: names for path, names in offenders.items() if names} == {}
