"""The one outage rule (:mod:`mostovik_pipelines.core.outages`): one table of budgets with a
setting per store, one classifier of "the store is away", one clock per store and target, and
``ride_out`` giving up past the budget naming the setting."""

from __future__ import annotations

import time

import psycopg
import pytest
import sqlalchemy

from mostovik_pipelines.core import outages
from mostovik_pipelines.core.errors import classify
from mostovik_pipelines.core.outages import (
    BUDGETS,
    Store,
    StoreAway,
    away_store,
    database_of,
    is_away,
    ride_out,
)
from mostovik_pipelines_tests.support.postgres import free_port


def test_every_store_has_one_setting_of_its_own():
    settings = [budget.setting for budget in BUDGETS.values()]
    assert set(BUDGETS) == set(Store)
    assert len(set(settings)) == len(settings)
    assert "MOSTOVIK_DAGSTER_PG_OUTAGE_SECONDS" in settings  # kept: deployments set it


def test_the_storage_url_and_the_claims_dsn_name_the_same_database() -> None:
    storage = "postgresql+psycopg2://dagster:secret@127.0.0.1:5433/dagster_runs"
    claim = "postgresql://dagster:secret@127.0.0.1:5433/dagster_runs"
    assert database_of(storage) == database_of(claim) == "127.0.0.1:5433/dagster_runs"
    assert "secret" not in database_of(storage)
    assert database_of("postgresql://127.0.0.1/other") == "127.0.0.1:5432/other"


def test_one_outage_is_one_clock_per_store_and_target_until_it_answers() -> None:
    target = "clock_test"
    first = outages.away_for(Store.RUN_STORAGE, target)
    time.sleep(0.05)
    assert outages.away_for(Store.RUN_STORAGE, target) >= first + 0.05
    assert outages.away_for(Store.RUN_STORAGE, target, since=time.monotonic() - 60) >= 60
    assert outages.away_for(Store.WAREHOUSE, target) < 1  # another store's clock
    outages.answered(Store.RUN_STORAGE, target)
    assert outages.away_for(Store.RUN_STORAGE, target) < 1
    outages.answered(Store.RUN_STORAGE, target)
    outages.answered(Store.WAREHOUSE, target)


def _refused_connection() -> psycopg.OperationalError:
    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect(f"postgresql://nobody@127.0.0.1:{free_port()}/nowhere", connect_timeout=2)
    return refused.value


def test_a_database_that_refuses_the_connection_is_away_a_wrong_password_is_not():
    away = _refused_connection()
    assert is_away(Store.WAREHOUSE, away) and is_away(Store.RUN_STORAGE, away)
    assert not is_away(Store.OBJECT_STORE, away)
    wrapped = sqlalchemy.exc.OperationalError("SELECT 1", {}, away)
    assert is_away(Store.WAREHOUSE, wrapped)
    # Raised from another error (a storage built on a refused connection): read by its cause.
    try:
        try:
            raise away
        except psycopg.OperationalError as error:
            raise RuntimeError("could not build the storage") from error
    except RuntimeError as built:
        assert away_store((Store.OBJECT_STORE, Store.RUN_STORAGE), built) is Store.RUN_STORAGE

    wrong_password = psycopg.OperationalError(
        'connection to server at "127.0.0.1", port 5432 failed: FATAL:  password '
        'authentication failed for user "dagster"')
    assert classify(wrong_password).kind == "configuration_error"
    assert not is_away(Store.RUN_STORAGE, wrong_password)


def test_the_broker_is_away_when_its_connection_fails():
    assert is_away(Store.BROKER, ConnectionRefusedError(111, "Connection refused"))
    assert not is_away(Store.BROKER, ValueError("a bug"))
    assert not is_away(Store.WAREHOUSE, ConnectionRefusedError(111, "Connection refused"))


def test_a_call_is_made_again_while_the_store_is_away_and_its_waits_are_told(monkeypatch):
    monkeypatch.setattr(outages, "FIRST_WAIT_SECONDS", 0.01)
    answers = [_refused_connection(), _refused_connection(), "rows"]
    told = []

    def call():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert ride_out(Store.WAREHOUSE, call, target="made_again",
                    on_wait=lambda store, error, seconds, wait: told.append(store)) == "rows"
    assert told == [Store.WAREHOUSE, Store.WAREHOUSE]
    assert outages.away_for(Store.WAREHOUSE, "made_again") < 1  # answered: the clock stopped
    outages.answered(Store.WAREHOUSE, "made_again")


def test_past_its_budget_the_store_away_is_given_up_naming_the_setting_and_not_ridden_again(
    monkeypatch
):
    monkeypatch.setenv(BUDGETS[Store.WAREHOUSE].setting, "0.3")
    monkeypatch.setattr(outages, "FIRST_WAIT_SECONDS", 0.05)
    refused = _refused_connection()

    def away():
        raise refused

    started = time.monotonic()
    with pytest.raises(StoreAway) as gone:
        ride_out(Store.WAREHOUSE, away, target="past_budget", on_wait=lambda *_: None)
    assert 0.3 <= time.monotonic() - started < 3
    assert "past the 0 s a run rides out (MOSTOVIK_WAREHOUSE_OUTAGE_SECONDS)" in str(gone.value)
    verdict = classify(gone.value)
    assert verdict.transient and not verdict.retried_by_step and not verdict.outage
    # An outer ride-out of the same store does not wait a second budget.
    assert not is_away(Store.WAREHOUSE, gone.value)
    outages.answered(Store.WAREHOUSE, "past_budget")


def test_any_other_failure_is_raised_at_once():
    calls = []

    def broken():
        calls.append(1)
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        ride_out((Store.WAREHOUSE, Store.OBJECT_STORE), broken)
    assert calls == [1]


def test_a_call_that_passes_without_the_store_does_not_end_its_outage(monkeypatch):
    """A storage call answered from memory passes while the database is away: the outage goes
    on (it restarted the clock, and a run gave up past the budget four times over, once per
    call that failed after it). A failure long after the last one seen starts a new outage."""
    target = "passes_without"
    outages.away_for(Store.RUN_STORAGE, target, since=time.monotonic() - 60)
    assert ride_out(Store.RUN_STORAGE, lambda: "from memory", target=target) == "from memory"
    assert outages.away_for(Store.RUN_STORAGE, target) >= 60
    assert ride_out(Store.RUN_STORAGE, lambda: "connected", target=target, answers=True)
    assert outages.away_for(Store.RUN_STORAGE, target) < 1
    monkeypatch.setattr(outages, "STALE_SECONDS", 0.05)
    outages.away_for(Store.RUN_STORAGE, target, since=time.monotonic() - 60)
    time.sleep(0.1)
    assert outages.away_for(Store.RUN_STORAGE, target) < 1
    outages.answered(Store.RUN_STORAGE, target)
