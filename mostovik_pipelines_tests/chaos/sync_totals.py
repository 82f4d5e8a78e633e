"""What the sync suite counts, and its summary."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from mostovik_pipelines_tests.chaos.tally import counts_text, named


@dataclass
class SyncTotals:
    scenarios: int = 0
    runs: Counter = field(default_factory=Counter)
    """Runs started, by kind (warm, cli)."""
    settle_runs: int = 0
    kills: Counter = field(default_factory=Counter)
    """Kills delivered, by point."""
    cli_kills: int = 0
    faults: Counter = field(default_factory=Counter)
    source_changes: Counter = field(default_factory=Counter)
    duplicate_runs: int = 0
    old_window_reruns: int = 0
    """Runs of a window older than the window run just before it."""
    resumes_checked: int = 0
    """Runs of a window holding a checkpoint whose requests were checked."""
    resumes_narrowed: int = 0
    """Of those, runs that resumed through a narrowed window (the token had expired)."""
    resume_violations: int = 0
    differences: int = 0
    duplicates: int = 0
    stale_checkpoints: int = 0
    unsettled: int = 0
    failures: list[str] = field(default_factory=list)
    distinct_problems: set[str] = field(default_factory=set)
    """Problems as judged, once each: a difference left standing is found again by every later
    judgement."""

def sync_summary(totals: SyncTotals, replay: str, seconds: float) -> str:
    return "\n".join([
        "",
        "sync chaos summary (erp_work_orders)",
        f"  scenarios run:        {totals.scenarios}",
        f"  runs started:         {sum(totals.runs.values())} ({counts_text(totals.runs)}); "
        f"settling runs {totals.settle_runs}",
        f"  kills delivered:      {sum(totals.kills.values())} ({counts_text(totals.kills)}); "
        f"of dagster job execute processes: {totals.cli_kills}",
        f"  faults injected:      {sum(totals.faults.values())} ({counts_text(totals.faults)})",
        f"  source changes:       {sum(totals.source_changes.values())} "
        f"({counts_text(totals.source_changes)})",
        f"  duplicate runs:       {totals.duplicate_runs}",
        f"  old windows re-run after newer ones: {totals.old_window_reruns}",
        f"  resumes checked:      {totals.resumes_checked} (narrowed after an expired token: "
        f"{totals.resumes_narrowed}); violations: {totals.resume_violations}",
        f"  differences found:    {totals.differences} (distinct problems: "
        f"{len(totals.distinct_problems)})",
        f"  duplicates found:     {totals.duplicates}",
        f"  stale checkpoints:    {totals.stale_checkpoints}",
        f"  unsettled windows:    {totals.unsettled}",
        f"  failures:             {len(totals.failures)}",
        f"  wall time:            {seconds:.0f} s",
        f"  replay:               python -m mostovik_pipelines_tests.chaos.sync_scenarios "
        f"{replay}",
    ])



def sync_faults(totals: SyncTotals) -> Counter:
    """What a sync scenario met: source faults, kills by point, source changes, duplicate runs,
    old windows re-run after newer ones."""
    return (named("source", totals.faults) + named("kill at", totals.kills)
            + named("change", totals.source_changes)
            + Counter({"duplicate run": totals.duplicate_runs,
                       "old window re-run": totals.old_window_reruns}))

