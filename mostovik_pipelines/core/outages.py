"""One rule for a part we stand on being away: :func:`ride_out` a call while the store is away,
for that store's budget of one outage, then give up naming its setting.

The stores and their budgets (:data:`BUDGETS`, one setting each, 90 s by default: a restart or a
failover takes ten to sixty seconds):

* the warehouse (``MOSTOVIK_WAREHOUSE_OUTAGE_SECONDS``): every step's loads, checks and reads;
* the object store of the landing store and the op outputs
  (``MOSTOVIK_OBJECT_STORE_OUTAGE_SECONDS``);
* the run storage database (``MOSTOVIK_DAGSTER_PG_OUTAGE_SECONDS``): the instance's storage calls
  (``platform/instance_storage.py``) and a run's claim (:mod:`.platform.claims`);
* the Celery broker and result backend (``MOSTOVIK_CELERY_OUTAGE_SECONDS``): the executor's calls
  (``platform/execution.py``).

Whether an error means the store is away is decided once, by :func:`is_away`, from the one error
classifier (:func:`.errors.classify`): the database dropped or refused the connection, or is
shutting down or starting up (a server that answers and refuses us, for a wrong password or a
missing database, is a setting of ours and fails at once); the object store does not answer or
cannot serve now; the broker cannot be reached.

One outage is one budget: the process keeps one clock per store and target (a database, a
bucket, a broker), started by the first failure anyone in the process saw and stopped by the
first answer, so a run whose claim, storage calls and steps all meet the same outage gives up
once, at the budget, not after several budgets in a row. Past the budget :class:`StoreAway` is
raised: a transient failure that says which store, for how long, and which setting to raise;
a step does not retry it (its budget is spent), a later run may.

A new kind of transient error is classified in :mod:`.errors`; a new store is a line of
:data:`BUDGETS` and the calls that reach it wrapped in :func:`ride_out`.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from mostovik_pipelines.core.errors import (
    PipelineError,
    TransientError,
    broker_unreachable,
    classify,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

FIRST_WAIT_SECONDS = 0.5
MAX_WAIT_SECONDS = 5.0
"""Waits between tries while a store is away double from the first to this: a store that comes
back is used again within seconds."""


class Store(enum.Enum):
    WAREHOUSE = "warehouse"
    OBJECT_STORE = "object_store"
    RUN_STORAGE = "run_storage"
    BROKER = "broker"


@dataclass(frozen=True)
class Budget:
    """How long one outage of a store is ridden out, and the setting that changes it."""

    what: str
    setting: str
    default_seconds: float = 90.0

    def seconds(self) -> float:
        return float(os.environ.get(self.setting) or self.default_seconds)


BUDGETS: dict[Store, Budget] = {
    Store.WAREHOUSE: Budget("the warehouse", "MOSTOVIK_WAREHOUSE_OUTAGE_SECONDS"),
    Store.OBJECT_STORE: Budget("the object store", "MOSTOVIK_OBJECT_STORE_OUTAGE_SECONDS"),
    Store.RUN_STORAGE: Budget("the run storage database", "MOSTOVIK_DAGSTER_PG_OUTAGE_SECONDS"),
    Store.BROKER: Budget("the Celery broker or result backend", "MOSTOVIK_CELERY_OUTAGE_SECONDS"),
}
"""The one table of outage budgets: one setting per store."""

AWAY_KINDS = {
    Store.WAREHOUSE: "database_connection_lost",
    Store.OBJECT_STORE: "object_store_unreachable",
    Store.RUN_STORAGE: "database_connection_lost",
}
"""The error kind (:func:`.errors.classify`) that says each store is away; the broker's errors
are told by :func:`.errors.broker_unreachable` (a result consumer that gave up reconnecting
included)."""


def budget_seconds(store: Store) -> float:
    return BUDGETS[store].seconds()


def setting_of(store: Store) -> str:
    return BUDGETS[store].setting


class StoreAway(TransientError):
    """A store stayed away past its outage budget. Transient (a later run may find it back), but
    not retried by the step that met it: its budget is spent."""

    kind = "store_away"

    def __init__(self, store: Store, seconds: float, reason: str) -> None:
        budget = BUDGETS[store]
        super().__init__(f"{budget.what} away for {seconds:.0f} s, past the "
                         f"{budget.seconds():.0f} s a run rides out ({budget.setting}): {reason}")
        self.store = store


def away_store(stores: Store | tuple[Store, ...], error: BaseException) -> Store | None:
    """Which of ``stores`` ``error`` says is away, if any: the one classifier of "away". An
    error raised from another (a storage call failing because its connection could not be
    opened) is read by its cause; a :class:`StoreAway` is never away again (its budget ran)."""
    stores = stores if isinstance(stores, tuple) else (stores,)
    seen = 0
    while error is not None and seen < 3:
        if isinstance(error, StoreAway):
            return None
        kind = classify(error).kind
        for store in stores:
            if (broker_unreachable(error) if store is Store.BROKER
                    else kind == AWAY_KINDS[store]):
                return store
        if isinstance(error, PipelineError):
            return None
        error, seen = error.__cause__, seen + 1
    return None


def is_away(store: Store, error: BaseException) -> bool:
    return away_store(store, error) is not None


def ride_out(stores: Store | tuple[Store, ...], call: Callable[[], T], *, target: str = "",
             since: float | None = None, answers: bool = False,
             on_wait: Callable[[Store, BaseException, float, float], None] | None = None) -> T:
    """``call()``, made again with backoff while it fails because one of ``stores`` is away,
    for up to that store's budget of one outage (on the process's clock of the store and
    ``target``, counted from ``since`` if that is earlier: when it last answered); past it,
    :class:`StoreAway`. Each wait is told to ``on_wait(store, error, seconds away, wait)``, by
    default a warning in the process's log. ``call`` must be safe to make again: a read, a
    whole write, or a transaction that was rolled back.

    The outage is over (:func:`answered`) when the call passes after it met the store away, or
    whenever it passes if ``answers`` (it cannot pass without the store: a new connection, an
    upload); a call that may pass without the store (a storage call answered from memory)
    proves nothing, and while the store stays away the clock goes on."""
    stores = stores if isinstance(stores, tuple) else (stores,)
    met: set[Store] = set()
    wait = FIRST_WAIT_SECONDS
    while True:
        try:
            result = call()
        except Exception as error:
            store = away_store(stores, error)
            if store is None:
                raise
            met.add(store)
            seconds = away_for(store, target, since)
            budget = budget_seconds(store)
            if seconds >= budget:
                gave_up = StoreAway(store, seconds, first_line(error))
                logger.error("%s", gave_up)
                raise gave_up from error
            pause = min(wait, budget - seconds)
            (on_wait or _log_wait)(store, error, seconds, pause)
            time.sleep(pause)
            wait = min(wait * 2, MAX_WAIT_SECONDS)
            continue
        for store in stores if answers else met:
            answered(store, target)
        return result


def wait_message(store: Store, error: BaseException, seconds: float, wait: float) -> str:
    """What a wait says: the store, why, and how much of its budget is ridden out."""
    budget = BUDGETS[store]
    return (f"{budget.what} away ({first_line(error)}); trying again in {wait:.1f} s, "
            f"{seconds + wait:.0f} s of an outage of up to {budget.seconds():.0f} s ridden out "
            f"({budget.setting})")


def _log_wait(store: Store, error: BaseException, seconds: float, wait: float) -> None:
    logger.warning("%s", wait_message(store, error, seconds, wait))


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


# --- the clock: one outage, one budget, per store and target, for the whole process ------------

STALE_SECONDS = 30.0
"""A failure this long after the last one anyone in the process saw starts a new outage: the
store answered in between, to a call that could not say so (riders wait 5 s at most between
tries, so a continuing outage is seen far more often)."""

_guard = threading.Lock()
_away_since: dict[tuple[Store, str], float] = {}
_last_seen: dict[tuple[Store, str], float] = {}


def away_for(store: Store, target: str = "", since: float | None = None) -> float:
    """Seconds ``store`` (``target``) has been away on the monotonic clock, counting from the
    first failure anyone in the process saw in this outage, or from ``since`` (when it last
    answered) if that is earlier."""
    now = time.monotonic()
    key = (store, target)
    with _guard:
        start = _away_since.get(key, now)
        if now - _last_seen.get(key, now) > STALE_SECONDS:
            start = now
        start = min(start, now if since is None else since)
        _away_since[key] = start
        _last_seen[key] = now
        return now - start


def answered(store: Store, target: str = "") -> None:
    """The store answered: its outage, if any, is over."""
    with _guard:
        _away_since.pop((store, target), None)
        _last_seen.pop((store, target), None)


def database_of(url: str) -> str:
    """The database a storage URL or a libpq DSN names (``postgresql+psycopg2://...`` or
    ``postgresql://...``), without credentials: the target of its clock."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url) if url else None
    if parsed is None:
        return ":5432/"
    return f"{parsed.host or ''}:{parsed.port or 5432}/{parsed.database or ''}"
