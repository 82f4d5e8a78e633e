"""The randomized reliability suite of ADR-011: crashes, faults, duplicates, re-runs, ranged runs
and re-executions of older runs against a real PostgreSQL, judged against a clean reference run
and the rows kept for unreadable currencies (see :mod:`.scenarios`). ``make chaos`` runs it (see
:mod:`.__main__`); ``test_chaos.py`` runs a short fixed-seed version inside ``make test``."""

from __future__ import annotations

import time
from collections import Counter

from mostovik_pipelines_tests.chaos.environment import ChaosEnvironment
from mostovik_pipelines_tests.chaos.parser_totals import Totals
from mostovik_pipelines_tests.chaos.scenarios import ChaosSuite
from mostovik_pipelines_tests.chaos.tally import Tally, named, tallied


def run_chaos(env: ChaosEnvironment, seed: int, scenarios: int, cli_share: float = 0.35,
              log=print, tally: Tally | None = None) -> Totals:
    """Run ``scenarios`` scenarios and print the summary; the totals say what happened (and,
    per scenario and fault, ``tally``)."""
    started = time.monotonic()
    suite = ChaosSuite(env, seed, cli_share=cli_share, log=log)

    def findings(totals: Totals) -> dict[str, int]:
        return {"differences": totals.differences, "duplicates": totals.duplicates,
                "unsettled": totals.errors, "stuck": len(env.stuck_runs())}

    if tally is not None:
        tallied(suite, "parser", tally, parser_faults, findings)
    totals = suite.run(scenarios)
    if tally is not None:
        tally.settle("parser", "final sweep", **findings(totals))
    log(summary(totals, seed, time.monotonic() - started))
    return totals


def parser_faults(totals: Totals) -> Counter:
    """What a parser scenario met: source faults, kills by point, warehouse crashes, duplicate
    runs, re-executions, ranged runs."""
    return (named("source", totals.faults) + named("kill at", totals.kills)
            + named("warehouse crash at", totals.warehouse_crashes)
            + named("re-execution", totals.reexecutions)
            + Counter({"duplicate run": totals.duplicate_runs, "ranged run": totals.ranged_runs,
                       "left started": totals.left_started}))


def summary(totals: Totals, seed: int, seconds: float) -> str:
    kills = sum(totals.kills.values())
    share = totals.scenarios_with_cli_kill / totals.scenarios if totals.scenarios else 0.0
    reexecutions = sum(totals.reexecutions.values())
    lines = [
        "",
        "chaos summary",
        f"  scenarios run:        {totals.scenarios}",
        f"  kills delivered:      {kills} ({_counts(totals.kills)})",
        f"  of which dagster job execute processes: {totals.cli_kills}, in "
        f"{totals.scenarios_with_cli_kill} scenarios ({share:.0%})",
        f"  killed runs left started (not recorded as failed): {totals.left_started}",
        f"  warehouse crashes:    {sum(totals.warehouse_crashes.values())} "
        f"({_counts(totals.warehouse_crashes)}); runs failed on one, within the budget: "
        f"{totals.failed_within_budget}",
        f"  faults injected:      {sum(totals.faults.values())} ({_counts(totals.faults)})",
        f"  source changes:       {totals.source_changes}; making a currency unreadable "
        f"{totals.unreadable_changes} (a stored rate, between fetches: "
        f"{totals.unreadable_between_fetches}; unreadable again, another value: "
        f"{totals.unreadable_again})",
        f"  duplicate runs:       {totals.duplicate_runs}",
        f"  re-runs of loaded partitions: {totals.reruns_of_loaded}",
        f"  re-executions:        {reexecutions} ({_counts(totals.reexecutions)}); of older "
        f"runs after newer ones: {totals.reexecutions_of_older_runs}; killed: "
        f"{totals.reexecutions_killed}",
        f"  ranged runs:          {totals.ranged_runs}, with {totals.ranged_failed_partitions} "
        "failing partitions (then re-executed from failure)",
        f"  runs started:         {sum(totals.runs.values())} "
        f"(cli {totals.runs['cli']}, warm {totals.runs['warm']}; settling re-runs "
        f"{totals.settle_runs}, refresh runs {totals.refresh_runs})",
        f"  liveness checks after kills: {totals.liveness_checks} (by a settling re-run, "
        f"else a run of their own: {totals.liveness_runs})",
        f"  blocked partitions:   {totals.blocked}",
        f"  kept rows expected at the end: {totals.kept_rows}",
        f"  differences found:    {totals.differences}",
        f"  duplicates found:     {totals.duplicates}",
        f"  unsettled partitions or failed references: {totals.errors}",
        f"  wall time:            {seconds:.0f} s",
        f"  seed:                 {seed}   (replay: make chaos CHAOS_ARGS='--seed {seed} "
        f"--suites parser --scenarios {totals.scenarios}')",
    ]
    return "\n".join(lines)


def _counts(counter) -> str:
    return ", ".join(f"{key} {n}" for key, n in sorted(counter.items()))
