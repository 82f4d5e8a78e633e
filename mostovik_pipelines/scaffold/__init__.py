"""``mostovik new-source NAME --type parser|sync|file``: a new source's files, written from the
templates of its kind, that pass their tests as they are.

It writes the source module (its declaration and its two functions), the source's partitions in
``partitions.py``, its stand-in endpoint (an HTTP source's; a file source's stand-in is its
inbox), its test module, its bad-input corpus and, last, its migration, generated from the
table the module declares (:mod:`mostovik_pipelines.warehouse.freeze`). Every one of these is
found by convention; nothing is registered anywhere. After changing the declared table, while
its migration is still the newest, ``--migration-only`` writes the migration again.
"""

from __future__ import annotations

import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

from mostovik_pipelines.warehouse.freeze import VERSIONS_DIR, write_migration

PACKAGE = Path(__file__).resolve().parents[1]
REPO = PACKAGE.parent
TEMPLATES = Path(__file__).parent / "templates"
JOB_TYPES = ("parser", "sync", "file")
NAME = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
LONGEST_NAME = 24
"""Table, asset and job are named after the source, and the templates' lines fit it."""


class ScaffoldRefused(Exception):
    """The scaffold cannot write what was asked; the message says why."""


@dataclass(frozen=True)
class Written:
    path: Path
    lines: int
    appended: bool = False

    def __str__(self) -> str:
        verb = "appended" if self.appended else "wrote"
        lines = f"{self.lines} line" + ("" if self.lines == 1 else "s")
        return f"{verb} {self.path.relative_to(REPO)} ({lines})"


def new_source(name: str, job_type: str) -> list[Written]:
    """Write a working source of ``job_type`` named ``name``, with everything around it."""
    if not NAME.match(name) or len(name) > LONGEST_NAME:
        raise ScaffoldRefused(f"{name!r} is not a source name: lowercase words joined by '_', "
                              f"at most {LONGEST_NAME} characters")
    if job_type not in JOB_TYPES:
        raise ScaffoldRefused(f"--type is one of {', '.join(JOB_TYPES)}")
    module = PACKAGE / "sources" / f"{name}.py"
    templates = TEMPLATES / job_type
    values = {"name": name, "NAME": name.upper(),
              "Name": "".join(part.title() for part in name.split("_")),
              "title": name.replace("_", " ").capitalize()}
    targets = {
        module: templates / "source.py.tmpl",
        PACKAGE / "standin" / f"{name}.py": templates / "standin.py.tmpl",
        REPO / "mostovik_pipelines_tests" / "sources" / f"test_{name}.py": (
            templates / "test.py.tmpl"),
        **{REPO / "mostovik_pipelines_tests" / "corpus" / name / case.name.removesuffix(
            ".tmpl"): case for case in sorted((templates / "corpus").iterdir())},
    }
    files = {path: _render(template, values) if template.suffix == ".tmpl" else (
        template.read_text()) for path, template in targets.items() if template.exists()}
    existing = [str(path.relative_to(REPO)) for path in files if path.exists()]
    if existing:
        raise ScaffoldRefused(f"{', '.join(existing)} exist(s) already")
    written = [_write(path, text) for path, text in files.items()]
    partitions = PACKAGE / "partitions.py"
    addition = _render(templates / "partition.py.tmpl", values)
    with partitions.open("a") as file:
        file.write(addition)
    written.append(Written(partitions, len(addition.strip("\n").splitlines()), appended=True))
    written.append(source_migration(name))
    return written


def source_migration(name: str) -> Written:
    """Write (or, while it is the newest, rewrite) the migration of the table the source
    module declares, from the module as it is now."""
    _forget_loaded(name)
    module = importlib.import_module(f"mostovik_pipelines.sources.{name}")
    spec = getattr(module, "SOURCE", None)
    if spec is None:
        raise ScaffoldRefused(f"mostovik_pipelines/sources/{name}.py declares no SOURCE")
    summary = (module.__doc__ or name).split("\n\n")[0].replace("\n", " ").rstrip(".")
    own = list(VERSIONS_DIR.glob(f"[0-9][0-9][0-9][0-9]_{spec.table.name}.py"))
    path = write_migration(spec.table, summary, replace=bool(own))
    return Written(path, len(path.read_text().splitlines()))


def _forget_loaded(name: str) -> None:
    """Drop modules this process loaded before the scaffold changed them (partitions, the
    source), so that the migration is generated from the files as they are now."""
    importlib.invalidate_caches()
    for module in ("mostovik_pipelines.partitions", f"mostovik_pipelines.sources.{name}"):
        sys.modules.pop(module, None)


def _render(template: Path, values: dict[str, str]) -> str:
    return Template(template.read_text()).substitute(values)


def _write(path: Path, text: str) -> Written:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return Written(path, len(text.splitlines()))
