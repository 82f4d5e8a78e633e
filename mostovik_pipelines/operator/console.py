"""How the ``mostovik`` command answers: its exit codes, its errors, the instance it reads.

Exit codes, for scripts: 0 success; 1 a job failed (or, for ``jobs list --stuck``, stuck jobs
were found); 2 a usage error (unknown source, bad period, no DAGSTER_HOME); 3 unknown run id.
Errors go to stderr, results to stdout (``--json`` for machines).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, NoReturn

import click

from mostovik_pipelines.operator.local_runs import EXIT_JOB_FAILED, EXIT_NOT_FOUND, EXIT_USAGE

if TYPE_CHECKING:
    from dagster import DagsterInstance

__all__ = ["EXIT_JOB_FAILED", "EXIT_NOT_FOUND", "EXIT_USAGE", "fail", "instance_of_home",
           "known_source"]


def fail(code: int, message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def instance_of_home() -> DagsterInstance:
    """The Dagster instance of ``DAGSTER_HOME``; a usage error without one."""
    from dagster import DagsterInstance

    if not os.environ.get("DAGSTER_HOME"):
        fail(EXIT_USAGE, "DAGSTER_HOME is not set: point it at the Dagster instance to read")
    return DagsterInstance.get()


def known_source(source: str | None) -> None:
    """A usage error naming the known sources, unless ``source`` is one (or None)."""
    from mostovik_pipelines.sources import ALL_SOURCES

    names = sorted(spec.name for spec in ALL_SOURCES)
    if source is not None and source not in names:
        fail(EXIT_USAGE, f"unknown source {source!r}; known: {', '.join(names)}")
