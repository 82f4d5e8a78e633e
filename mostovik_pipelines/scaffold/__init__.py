"""``mostovik new-source NAME --type parser|sync|file``: a new source's files, written from the
templates of its kind, that pass their tests as they are.

It writes the source's folder, ``mostovik_pipelines/sources/<name>/``: ``source.py`` (its
table, partitions and declaration), ``parse.py`` (its two functions), ``standin.py`` (its
stand-in endpoint, an HTTP source's; a file source's stand-in is its inbox) and ``__init__.py``;
then its test folder, its bad-input corpus and, last, its migration, generated from the table
the source declares (:mod:`mostovik_pipelines.warehouse.freeze`). Each kind's templates are the
files its folder gets. Every one of these is new and found by convention: no file that exists
is changed, nothing is registered anywhere. After changing the declared table, while its
migration is still the newest, ``--migration-only`` writes the migration again.
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

    def __str__(self) -> str:
        lines = f"{self.lines} line" + ("" if self.lines == 1 else "s")
        return f"wrote {self.path.relative_to(REPO)} ({lines})"


def new_source(name: str, job_type: str) -> list[Written]:
    """Write a working source of ``job_type`` named ``name``, with everything around it."""
    if not NAME.match(name) or len(name) > LONGEST_NAME:
        raise ScaffoldRefused(f"{name!r} is not a source name: lowercase words joined by '_', "
                              f"at most {LONGEST_NAME} characters")
    if job_type not in JOB_TYPES:
        raise ScaffoldRefused(f"--type is one of {', '.join(JOB_TYPES)}")
    folder = PACKAGE / "sources" / name
    tests = REPO / "mostovik_pipelines_tests" / "sources" / name
    templates = TEMPLATES / job_type
    values = {"name": name, "NAME": name.upper(),
              "Name": "".join(part.title() for part in name.split("_")),
              "title": name.replace("_", " ").capitalize()}
    targets = {
        **{folder / f"{module}.py": templates / f"{module}.py.tmpl"
           for module in ("__init__", "source", "parse", "standin")},
        tests / f"test_{name}.py": templates / "test.py.tmpl",
        **{REPO / "mostovik_pipelines_tests" / "corpus" / name / case.name.removesuffix(
            ".tmpl"): case for case in sorted((templates / "corpus").iterdir())},
    }
    files = {path: _render(template, values) if template.suffix == ".tmpl" else (
        template.read_text()) for path, template in targets.items() if template.exists()}
    files[tests / "__init__.py"] = ""  # a package: the test module's name stays unique
    existing = [str(path.relative_to(REPO)) for path in files if path.exists()]
    if existing:
        raise ScaffoldRefused(f"{', '.join(existing)} exist(s) already")
    written = [_write(path, text) for path, text in files.items()]
    written.append(source_migration(name))
    return written


def source_migration(name: str) -> Written:
    """Write (or, while it is the newest, rewrite) the migration of the table the source
    module declares, from the module as it is now."""
    _forget_loaded(name)
    module = importlib.import_module(f"mostovik_pipelines.sources.{name}.source")
    spec = getattr(module, "SOURCE", None)
    if spec is None:
        raise ScaffoldRefused(f"mostovik_pipelines/sources/{name}/source.py declares no SOURCE")
    summary = (module.__doc__ or name).split("\n\n")[0].replace("\n", " ").rstrip(".")
    own = list(VERSIONS_DIR.glob(f"[0-9][0-9][0-9][0-9]_{spec.table.name}.py"))
    path = write_migration(spec.table, summary, replace=bool(own))
    return Written(path, len(path.read_text().splitlines()))


def _forget_loaded(name: str) -> None:
    """Drop the source's modules this process loaded before they changed, so that the migration
    is generated from the files as they are now."""
    importlib.invalidate_caches()
    package = f"mostovik_pipelines.sources.{name}"
    for module in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
        sys.modules.pop(module, None)


def _render(template: Path, values: dict[str, str]) -> str:
    return Template(template.read_text()).substitute(values)


def _write(path: Path, text: str) -> Written:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return Written(path, len(text.splitlines()))
