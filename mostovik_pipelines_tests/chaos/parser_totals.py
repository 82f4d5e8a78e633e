"""What the parser suite counts (its summary: :func:`mostovik_pipelines_tests.chaos.summary`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Totals:
    scenarios: int = 0
    kills: Counter = field(default_factory=Counter)
    warehouse_crashes: Counter = field(default_factory=Counter)
    """Crashes of the warehouse server under a run, per point of the run."""
    failed_within_budget: int = 0
    """Runs that failed on a warehouse crash shorter than the warehouse's outage budget: each a
    finding (unsettled), however exact the data ended."""
    cli_kills: int = 0
    scenarios_with_cli_kill: int = 0
    left_started: int = 0
    faults: Counter = field(default_factory=Counter)
    source_changes: int = 0
    unreadable_changes: int = 0
    """Changes that made a currency unreadable, newly or again with another value."""
    unreadable_again: int = 0
    unreadable_between_fetches: int = 0
    """Of those, changes that made a stored rate unreadable (it was loaded, the next fetch sees
    it unreadable)."""
    duplicate_runs: int = 0
    reruns_of_loaded: int = 0
    reexecutions: Counter = field(default_factory=Counter)
    """Re-executions by kind ("from failure, cli", "from failure, warm", "all steps, warm")."""
    reexecutions_of_older_runs: int = 0
    reexecutions_killed: int = 0
    ranged_runs: int = 0
    ranged_failed_partitions: int = 0
    settle_runs: int = 0
    refresh_runs: int = 0
    runs: Counter = field(default_factory=Counter)
    liveness_checks: int = 0
    liveness_runs: int = 0
    """Runs started only to check liveness (otherwise a settling re-run is the check)."""
    blocked: int = 0
    """Partitions a fresh run could not have within 30 s (or only after waiting over 20 s)."""
    kept_rows: int = 0
    """Kept rows in the expected states of the final sweep."""
    differences: int = 0
    duplicates: int = 0
    errors: int = 0
    """Failures that are not differences: a partition no re-run settled, a failed reference."""
    failures: list[str] = field(default_factory=list)
    reference_cache_hits: int = 0

