"""The platform suite's run storage away past the budget: the instance's PostgreSQL crashes
while a daemon-launched run's step is held in its fetch on a Celery worker, the fetch is let go
(the step goes on to write), and the database stays away longer than the outage a run rides out
(``MOSTOVIK_DAGSTER_PG_OUTAGE_SECONDS``, 90 s by default); then it comes back.

What the deployment promises past the budget: the run gives up cleanly, naming the setting
(in the output of its run worker or its step, which the code server's and the workers' logs
hold),
writes nothing half-way, and is not left "started": it could not record its own failure, so
the dead-run sensor marks it failed once the database is back and the daemon's run retries take
it up once, to exact data. Judged by the suite's judge as a dead run retried once
(:meth:`.PlatformSuite._judge`), and here: some run of the scenario did give up (a scenario
whose run finished before the outage proved nothing), and the logs name the setting, and no
other: the claim once waited on the step's budget (``MOSTOVIK_STEP_OUTAGE_SECONDS``), 90 s too
by default, and gave up naming it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from mostovik_pipelines.platform.instance_storage import DEFAULT_OUTAGE_SECONDS, OUTAGE_ENV
from mostovik_pipelines_tests.support.waiting import wait_for_hanging_request

PAST_BUDGET = "run_storage_past_budget"
PAST_BUDGET_MARGIN_SECONDS = 20.0
"""How far past the budget the database stays away: the run's clock may start a keeper's look
(2 s) before the crash, and its giving up takes a few seconds more."""


GAVE_UP = re.compile(r"(?:could not take it again within|past the) \d+ s(?: a run rides out)? "
                     r"\((MOSTOVIK_[A-Z_]+)\)")
"""A run's giving up on the run storage, from its claim (the fence) or a storage call, and the
setting it names."""


def past_budget_outage_seconds() -> float:
    return DEFAULT_OUTAGE_SECONDS + PAST_BUDGET_MARGIN_SECONDS


def storage_away_past_budget(suite, tag: dict[str, str], match: str) -> list[str]:
    """Once a step is held in its fetch: the run storage down, the fetch let go, the database
    away past the budget, then back. What went wrong before the judge looks, if anything."""
    standin = suite.chaos.standin
    storage = suite.platform.run_storage
    try:
        wait_for_hanging_request(standin, match)
        storage.pause()
        try:
            standin.clear_faults()
            standin.release_hangs()
            time.sleep(past_budget_outage_seconds())  # the fault's own length
        finally:
            storage.resume()
        return []
    finally:
        standin.clear_faults()
        standin.release_hangs()


def log_sizes(suite) -> dict[Path, int]:
    """Where each log of the deployment ends now (the daemon's holds its run workers' output)."""
    return {path: path.stat().st_size if path.exists() else 0 for path in _logs(suite)}


def gave_up_problems(suite, dead_runs_before: int, logs_before: dict[Path, int]) -> list[str]:
    """After the judge: a run of the scenario gave up (it was marked dead and retried), and the
    logs written since the scenario began name the setting whose budget ran out."""
    problems = []
    if suite.totals.dead_runs_retried == dead_runs_before:
        problems.append("no run gave up past the budget (it finished before the outage, or "
                        "rode it out): the scenario proved nothing")
    written = "".join(_tail(path, logs_before.get(path, 0)) for path in _logs(suite))
    named = set(GAVE_UP.findall(written))
    if OUTAGE_ENV not in named:
        problems.append(f"no log of the deployment names {OUTAGE_ENV} as the budget that ran "
                        "out")
    if named - {OUTAGE_ENV}:
        problems.append(f"a run gave up on the run storage naming {sorted(named - {OUTAGE_ENV})}: "
                        f"its claim and its storage calls ride out one budget, {OUTAGE_ENV}")
    return problems


def _logs(suite) -> list[Path]:
    """The daemon's, the code server's (its run workers' output) and the workers' logs."""
    return suite.platform.log_paths()


def _tail(path: Path, offset: int) -> str:
    if not path.exists():
        return ""
    with path.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")
