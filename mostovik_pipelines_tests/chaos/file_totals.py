"""What the file suite counts, and its summary."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from mostovik_pipelines_tests.chaos.tally import counts_text, named


@dataclass
class FileTotals:
    scenarios: int = 0
    drops: Counter = field(default_factory=Counter)
    ticks: int = 0
    requests_skipped: int = 0
    """Run requests the daemon would skip: their run key was launched before."""
    runs: Counter = field(default_factory=Counter)
    """Runs started: sensor (warm), sensor (cli), operator."""
    kills: Counter = field(default_factory=Counter)
    cli_kills: int = 0
    duplicate_runs: int = 0
    reupload_races: Counter = field(default_factory=Counter)
    """Re-uploads dropped while the older version's run was in flight, by point."""
    replays: int = 0
    """Operators' re-runs of an older version's landed payload (``reuse_landed``)."""
    superseded: int = 0
    """Loads refused because a newer version of the file was loaded first."""
    settle_runs: int = 0
    copies_left: int = 0
    """Identical re-uploads of a loaded version in the inbox at the last judgement (the sensor
    never requests a run key twice)."""
    stale_quarantine: int = 0
    """Quarantined rows of versions no longer loaded (kept under their own partition key)."""
    differences: int = 0
    duplicates: int = 0
    unsettled: int = 0
    failures: list[str] = field(default_factory=list)
    distinct_problems: set[str] = field(default_factory=set)
    """Problems as judged, once each: a difference left standing is found again by every later
    judgement."""


def file_summary(totals: FileTotals, replay: str, seconds: float) -> str:
    return "\n".join([
        "",
        "file chaos summary (material_deliveries)",
        f"  scenarios run:        {totals.scenarios}",
        f"  drops:                {sum(totals.drops.values())} ({counts_text(totals.drops)})",
        f"  sensor ticks:         {totals.ticks}; requests skipped for a launched run key: "
        f"{totals.requests_skipped}",
        f"  runs started:         {sum(totals.runs.values())} ({counts_text(totals.runs)}); "
        f"settling re-runs {totals.settle_runs}",
        f"  kills delivered:      {sum(totals.kills.values())} ({counts_text(totals.kills)}); "
        f"of dagster job execute processes: {totals.cli_kills}",
        f"  duplicate runs:       {totals.duplicate_runs}",
        f"  re-upload races:      {sum(totals.reupload_races.values())} "
        f"({counts_text(totals.reupload_races)}); loads refused as superseded: "
        f"{totals.superseded}",
        f"  replays of an older version's landed payload: {totals.replays}",
        f"  identical re-uploads left in the inbox: {totals.copies_left}",
        f"  quarantined rows of versions no longer loaded: {totals.stale_quarantine}",
        f"  differences found:    {totals.differences} (distinct problems: "
        f"{len(totals.distinct_problems)})",
        f"  duplicates found:     {totals.duplicates}",
        f"  unsettled files:      {totals.unsettled}",
        f"  failures:             {len(totals.failures)}",
        f"  wall time:            {seconds:.0f} s",
        f"  replay:               python -m mostovik_pipelines_tests.chaos.file_scenarios "
        f"{replay}",
    ])



def file_faults(totals: FileTotals) -> Counter:
    """What a file scenario met: drops by kind, kills by point, re-uploads racing a run,
    duplicate runs, operators' replays."""
    return (named("drop", totals.drops) + named("kill at", totals.kills)
            + named("re-upload racing at", totals.reupload_races)
            + Counter({"duplicate run": totals.duplicate_runs, "replay": totals.replays}))

