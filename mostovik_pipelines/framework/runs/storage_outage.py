"""One clock per run storage database for how long it has been away, shared by everything in
the process that talks to it: the instance storage's calls (``instance_storage.py``) and the
run claim's keeper and fence (:mod:`.claims`). One outage is then one budget.

Each used to time the outage from its own first failure. A run whose storage went away while
its source was slow waited the budget out in the fence (its claim could not be taken again),
failed its step, and then waited a second budget storing that failure: the process gave up
217 s into an outage at the 90 s defaults, where an operator reads 90
(``test_production_instance.py::test_a_run_storage_away_past_the_90_s_budget_under_a_live_run_fails_it_writing_nothing``).
"""

from __future__ import annotations

import os
import threading
import time

BUDGET_ENV = "MOSTOVIK_DAGSTER_PG_OUTAGE_SECONDS"
DEFAULT_BUDGET_SECONDS = 90.0


def budget_seconds() -> float:
    """How long one outage of the run storage database is ridden out, by its storage calls and
    by the run's claim alike (the claim lives in that database): past it the run gives up."""
    return float(os.environ.get(BUDGET_ENV) or DEFAULT_BUDGET_SECONDS)


_guard = threading.Lock()
_away_since: dict[str, float] = {}


def database_key(host: str | None, port: int | str | None, database: str | None) -> str:
    """The database a connection goes to, the same whichever driver's settings it comes from."""
    return f"{host or ''}:{port or 5432}/{database or ''}"


def database_of(url: str) -> str:
    """The database of a storage URL or libpq DSN (``postgresql+psycopg2://...`` or
    ``postgresql://...``), as the clock names it."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url) if url else None
    return database_key(*((parsed.host, parsed.port, parsed.database) if parsed
                          else (None, None, None)))


def answered(database: str) -> None:
    """The database answered: its outage, if any, is over."""
    with _guard:
        _away_since.pop(database, None)


def away_for(database: str, since: float | None = None) -> float:
    """Seconds the database has been away (monotonic clock), counting from the first failure
    anyone in the process saw, or from ``since`` (when it last answered) if that is earlier."""
    now = time.monotonic()
    with _guard:
        start = min(_away_since.get(database, now), now if since is None else since)
        _away_since[database] = start
        return now - start
