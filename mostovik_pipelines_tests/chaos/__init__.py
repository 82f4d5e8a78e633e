"""The randomized reliability suite of ADR-011: crashes, faults, duplicates and re-runs against a
real PostgreSQL, judged against a clean reference run. ``make chaos`` runs it (see
:mod:`.__main__`); ``test_chaos.py`` runs a short fixed-seed version inside ``make test``."""

from __future__ import annotations

import time

from mostovik_pipelines_tests.chaos.environment import ChaosEnvironment
from mostovik_pipelines_tests.chaos.scenarios import ChaosSuite, Totals


def run_chaos(env: ChaosEnvironment, seed: int, scenarios: int, cli_share: float = 0.35,
              log=print) -> Totals:
    """Run ``scenarios`` scenarios and print the summary; the totals say what happened."""
    started = time.monotonic()
    suite = ChaosSuite(env, seed, cli_share=cli_share, log=log)
    totals = suite.run(scenarios)
    log(summary(totals, seed, time.monotonic() - started))
    return totals


def summary(totals: Totals, seed: int, seconds: float) -> str:
    kills = sum(totals.kills.values())
    share = totals.scenarios_with_cli_kill / totals.scenarios if totals.scenarios else 0.0
    lines = [
        "",
        "chaos summary",
        f"  scenarios run:        {totals.scenarios}",
        f"  kills delivered:      {kills} "
        f"({', '.join(f'{k} {n}' for k, n in sorted(totals.kills.items()))})",
        f"  of which dagster job execute processes: {totals.cli_kills}, in "
        f"{totals.scenarios_with_cli_kill} scenarios ({share:.0%})",
        f"  faults injected:      {sum(totals.faults.values())} "
        f"({', '.join(f'{k} {n}' for k, n in sorted(totals.faults.items()))})",
        f"  source changes:       {totals.source_changes}",
        f"  duplicate runs:       {totals.duplicate_runs}",
        f"  re-runs of loaded partitions: {totals.reruns_of_loaded}",
        f"  runs started:         {sum(totals.runs.values())} "
        f"(cli {totals.runs['cli']}, warm {totals.runs['warm']}; settling re-runs "
        f"{totals.settle_runs})",
        f"  differences found:    {totals.differences}",
        f"  duplicates found:     {totals.duplicates}",
        f"  unsettled partitions or failed references: {totals.errors}",
        f"  wall time:            {seconds:.0f} s",
        f"  seed:                 {seed}   (replay: make chaos CHAOS_ARGS='--seed {seed} "
        f"--scenarios {totals.scenarios}')",
    ]
    return "\n".join(lines)
