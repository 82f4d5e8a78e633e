"""The layout's two rules, read from the source text: the framework imports no source, and a
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
