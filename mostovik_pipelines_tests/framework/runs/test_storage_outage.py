"""One outage clock per run storage database, whichever driver's settings name it."""

from __future__ import annotations

import time

import mostovik_pipelines.framework.runs.storage_outage as storage_outage


def test_the_storage_url_and_the_claims_dsn_name_the_same_database() -> None:
    storage = "postgresql+psycopg2://dagster:secret@127.0.0.1:5433/dagster_runs"
    claim = "postgresql://dagster:secret@127.0.0.1:5433/dagster_runs"
    assert storage_outage.database_of(storage) == storage_outage.database_of(claim)
    assert storage_outage.database_of(storage) == "127.0.0.1:5433/dagster_runs"
    assert "secret" not in storage_outage.database_of(storage)
    assert storage_outage.database_of("postgresql://127.0.0.1/other") == "127.0.0.1:5432/other"


def test_one_outage_is_one_clock_until_the_database_answers() -> None:
    database = storage_outage.database_of("postgresql://127.0.0.1:1/clock_test")
    first = storage_outage.away_for(database)
    time.sleep(0.05)
    assert storage_outage.away_for(database) >= first + 0.05
    assert storage_outage.away_for(database, since=time.monotonic() - 60) >= 60
    storage_outage.answered(database)
    assert storage_outage.away_for(database) < 1
    storage_outage.answered(database)
