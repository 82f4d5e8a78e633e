"""Waiting on a thing's own record, never on the wall clock.

A test that needs something done by another process (a run, a daemon, a sensor, a stand-in
request) polls for the record that says it happened: a tick, a status, an event, a row. The
limit is only there to end a test that would otherwise hang; it is derived from the interval
the thing is configured with and is generous, since on a loaded machine a process can be slow
to start or be scheduled. A wait that is met returns at once, so a generous limit costs nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from mostovik_pipelines.standin import StandinClient

T = TypeVar("T")

PROCESS_START_MARGIN_SECONDS = 120.0
"""What a loaded 2-core machine may take to start a Dagster process (webserver, daemon, code
server, run worker) and let it act once: added to every limit derived from an interval."""
TICKS_OF_MARGIN = 6
"""How many of its own intervals a daemon, sensor or schedule may be late by."""


def limit_for(interval_seconds: float, ticks: int = 1) -> float:
    """The limit for ``ticks`` evaluations of something that evaluates every
    ``interval_seconds``: the ticks, a margin of ticks, and process start-up."""
    return (ticks + TICKS_OF_MARGIN) * interval_seconds + PROCESS_START_MARGIN_SECONDS


def wait_until(check: Callable[[], T], limit: float, what: str,
               diagnostics: Callable[[], str] = lambda: "", poll: float = 0.2) -> T:
    """The first truthy result of ``check``; fails naming ``what`` after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {limit:.0f} s\n{diagnostics()}")
        time.sleep(poll)


def wait_for_hanging_request(standin: StandinClient, match: str = "", count: int = 1,
                             limit: float = PROCESS_START_MARGIN_SECONDS) -> list[dict]:
    """The stand-in's requests hanging now whose query contains ``match``, once there are
    ``count`` of them (a run is inside its fetch, held there until the test releases it)."""
    return wait_until(
        lambda: (lambda hanging: hanging if len(hanging) >= count else None)(
            [r for r in standin.hanging() if match in r["query"]]),
        limit, f"{count} request(s) matching {match!r} hanging at the stand-in")
