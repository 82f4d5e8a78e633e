"""The platform suite's lost host: the orchestrating host of the production layout dies (the
daemon and the code server with the run workers it started, SIGKILL) while a run's step goes on
on a Celery worker, held in its fetch at the stand-in; both started again after the outage.

Nothing of the dead run's process is left to report it, and its step on the worker still holds
the run's claim: the dead-run sensor must tell the run dead from its driver claim and mark it
failed while that step goes on (before the driver claim, the held step kept the run "started"
for good), and the daemon's run retries take it up once. Judged by the suite's judge, which takes
such a run as ridden out when its one retry succeeded (:meth:`.PlatformSuite._judge`).
"""

from __future__ import annotations

import time
from datetime import date

from mostovik_pipelines.framework.runs.dead_runs import INTERVAL_SECONDS
from mostovik_pipelines_tests.support.waiting import (
    limit_for,
    wait_for_hanging_request,
    wait_until,
)

HOST = "host"
HELD_SECONDS = 600
"""How long the step's fetch is held at most: past the restart and the marking."""


def hold_fetch(suite, partitions: tuple[str, ...]) -> str:
    """Hold the first partition's fetch at the stand-in once; what the held request matches."""
    match = f"date_req={date.fromisoformat(partitions[0]):%d/%m/%Y}"
    suite.chaos.standin.fault("hang", seconds=HELD_SECONDS, match=match)
    return match


def lose_host(suite, outage: float, tag: dict[str, str], match: str) -> list[str]:
    """Once a step is held in its fetch on a worker: the host lost for ``outage`` seconds, the
    daemon started again, and the run marked failed while its step still hangs; then the step
    let go. What went wrong, if anything."""
    standin = suite.chaos.standin
    services = suite.platform.services
    try:
        wait_for_hanging_request(standin, match)
        services.kill_daemon(with_its_group=True)
        suite.platform.layout.kill_code_server()
        time.sleep(outage)  # the host away: the fault's own length
        suite.platform.layout.start_code_server()
        services.start_daemon()
        try:
            wait_until(lambda: any(run.status == "FAILURE" for run in suite.runs_tagged(tag)),
                       limit_for(INTERVAL_SECONDS, ticks=2),
                       "the dead run marked failed while its step runs")
        except AssertionError as error:
            return [str(error)[:3000]]
        return []
    finally:
        standin.clear_faults()
        standin.release_hangs()
