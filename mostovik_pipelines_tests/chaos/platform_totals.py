"""What the platform suite counts, and its summary."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from mostovik_pipelines_tests.chaos.tally import named


@dataclass
class PlatformTotals:
    scenarios: int = 0
    faults: Counter = field(default_factory=Counter)
    """Faults per kind."""
    longest_outage: dict[str, float] = field(default_factory=dict)
    points: Counter = field(default_factory=Counter)
    """Where the faults began: ``queued`` (right after the launch), ``running`` (a run had
    started), ``fetching`` (a step held in its fetch)."""
    launches: Counter = field(default_factory=Counter)
    runs: int = 0
    failed_runs: int = 0
    """Runs that did not succeed: a fault the deployment should have ridden out."""
    dead_runs_retried: int = 0
    """Runs of a lost host, or that gave up past the run storage's budget, marked failed and
    taken up by their one retry, which succeeded."""
    stuck_launches_retried: int = 0
    """Runs the daemon was launching as it died, failed by run monitoring's start timeout."""
    store_outages_met: int = 0
    """Object store outages a run met (a request in the fault, or a wait on the store)."""
    past_store_budget_retried: int = 0
    """Runs that gave up on the object store away past the budget, naming the setting, and
    whose one re-execution succeeded."""
    store_gave_up_seconds: list[float] = field(default_factory=list)
    """How far into the object store's outage past the budget its run gave up."""
    not_once: int = 0
    """Partitions materialised other than once by their scenario's runs."""
    left_unfinished: int = 0
    revived: Counter = field(default_factory=Counter)
    """The webserver or the daemon found exited and started again, as systemd does."""
    partitions: int = 0
    differences: int = 0
    duplicates: int = 0
    failures: list[str] = field(default_factory=list)


def platform_faults(totals: PlatformTotals) -> Counter:
    """What a platform scenario met: the part brought down."""
    return named("down:", totals.faults)


def platform_findings(totals: PlatformTotals) -> dict[str, int]:
    """A failed run or a partition not materialised once is a fault not ridden out."""
    return {"differences": totals.differences, "duplicates": totals.duplicates,
            "unsettled": totals.failed_runs + totals.not_once, "stuck": totals.left_unfinished}


def platform_summary(totals: PlatformTotals, seed: int, seconds: float) -> str:
    outages = ", ".join(
        f"{kind} {n}" + (f" (longest {totals.longest_outage[kind]:.0f} s)"
                         if kind in totals.longest_outage else "")
        for kind, n in sorted(totals.faults.items()))
    return "\n".join([
        "",
        "platform chaos summary",
        f"  scenarios run:        {totals.scenarios} ({_counts(totals.launches)}), "
        f"{totals.partitions} partitions",
        f"  faults per kind:      {outages}",
        f"  where they began:     {_counts(totals.points)}",
        f"  object store outages met by a run: {totals.store_outages_met} of "
        f"{totals.faults['object_store']}",
        f"  webserver or daemon exited, started again by the supervisor: "
        f"{sum(totals.revived.values())} ({_counts(totals.revived)})",
        f"  runs:                 {totals.runs}, of which failed: {totals.failed_runs}; "
        f"retried once to success after a lost daemon or host or the run storage away past "
        f"the budget: {totals.dead_runs_retried} "
        f"dead, {totals.stuck_launches_retried} never started; failed past the object "
        f"store's budget and re-executed once to success: {totals.past_store_budget_retried}"
        + (f" (gave up {', '.join(f'{s:.0f}' for s in totals.store_gave_up_seconds)} s into "
           "the outage)" if totals.store_gave_up_seconds else ""),
        f"  partitions not materialised exactly once: {totals.not_once}",
        f"  runs left unfinished: {totals.left_unfinished}",
        f"  differences found:    {totals.differences}",
        f"  duplicates found:     {totals.duplicates}",
        f"  failures:             {len(totals.failures)}",
        f"  wall time:            {seconds:.0f} s",
        f"  seed:                 {seed}",
    ])


def _counts(counter: Counter) -> str:
    return ", ".join(f"{key} {n}" for key, n in sorted(counter.items())) or "none"
