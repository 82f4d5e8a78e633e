"""How long each store keeps what (read from the environment), and what a prune removes."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from mostovik_pipelines.core.errors import ConfigurationError
from mostovik_pipelines.core.settings import (
    KEEP_FAILED_RUN_OUTPUTS_ENV,
    KEEP_LANDED_ENV,
    KEEP_RUNS_ENV,
    RETENTION_GRACE_ENV,
)

OP_OUTPUTS = "op outputs"
LANDING = "landing"
RUNS = "runs"
EVENT_LOG_FILES = "event log files"
"""A local (SQLite) instance's files of runs that are gone; none in production (PostgreSQL)."""
CLAIM_FILES = "claim files"
"""A local (SQLite) instance's claim files of runs whose process was killed; none in production."""
STORES = (OP_OUTPUTS, LANDING, RUNS, EVENT_LOG_FILES, CLAIM_FILES)


@dataclass(frozen=True)
class RetentionPolicy:
    """How long each store keeps what it no longer needs for the present state."""

    keep_failed_run_outputs: timedelta = timedelta(days=14)
    """How long a failed run can be re-executed from its failure (its op outputs are kept)."""
    grace: timedelta = timedelta(days=1)
    """How long a successful run's op outputs, and anything no record points to, are kept."""
    keep_landed: timedelta = timedelta(days=90)
    """How long a landed payload other than its partition's latest is kept."""
    keep_runs: timedelta = timedelta(days=400)
    """How long a run and its event log are kept, unless it holds a partition's latest state."""

    @classmethod
    def from_environment(cls) -> RetentionPolicy:
        """The policy the environment sets; a setting left out takes its default."""
        policy = cls(
            keep_failed_run_outputs=_days(KEEP_FAILED_RUN_OUTPUTS_ENV,
                                          cls.keep_failed_run_outputs),
            grace=_days(RETENTION_GRACE_ENV, cls.grace),
            keep_landed=_days(KEEP_LANDED_ENV, cls.keep_landed),
            keep_runs=_days(KEEP_RUNS_ENV, cls.keep_runs),
        )
        if not policy.grace <= policy.keep_failed_run_outputs <= policy.keep_runs:
            raise ConfigurationError(
                f"retention: {RETENTION_GRACE_ENV} <= {KEEP_FAILED_RUN_OUTPUTS_ENV} <= "
                f"{KEEP_RUNS_ENV} must hold (a failed run cannot be re-executed once its run "
                "record is gone)")
        return policy


def _days(name: str, default: timedelta) -> timedelta:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        days = float(raw)
    except ValueError:
        days = -1.0
    if days < 0:
        raise ConfigurationError(f"{name}={raw!r}: give a number of days, 0 or more")
    return timedelta(days=days)


@dataclass(frozen=True)
class Removal:
    """One thing a prune removes: a run, a directory or a file, and how."""

    store: str
    target: str
    size_bytes: int
    remove: Callable[[], None] = field(repr=False, compare=False)


@dataclass
class PruneReport:
    """What a prune removed (or, dry, would remove), per store."""

    dry_run: bool
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STORES, 0))
    size_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STORES, 0))

    def add(self, removal: Removal) -> None:
        self.counts[removal.store] += 1
        self.size_bytes[removal.store] += removal.size_bytes

    @property
    def removed_anything(self) -> bool:
        return any(self.counts.values())

    def lines(self) -> list[str]:
        verb = "would remove" if self.dry_run else "removed"
        units = {OP_OUTPUTS: "run directories", LANDING: "files", RUNS: "runs",
                 EVENT_LOG_FILES: "files of runs no longer in run storage",
                 CLAIM_FILES: "files of runs whose process died"}
        return [f"{store}: {verb} {self.counts[store]} {units[store]}"
                + (f", {self.size_bytes[store]} bytes" if store != RUNS else
                   " with their event logs") for store in STORES]
