"""Only the run storage being away is ridden out when a run takes its claim: a server that
answers and refuses us fails the step at once, naming the setting to fix and never its value.
(A server that is stopped, refusing the connection, is ridden out:
test_claims.py::test_a_claim_taken_while_the_database_is_away_is_held_once_it_answers.)"""

from __future__ import annotations

import os
import time
import uuid

import psycopg
import pytest
import sqlalchemy
from dagster import DagsterInstance

from mostovik_pipelines.core.errors import ConfigurationError, classify
from mostovik_pipelines.platform.claims import _postgres_dsn, hold_run_claim
from mostovik_pipelines_tests.support.instances import production_instance
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres

MAX_CONNECTIONS = 12


@pytest.fixture(scope="module")
def server():
    """A server of its own: these tests change its roles and fill its connections."""
    server = ThrowawayPostgres(max_connections=MAX_CONNECTIONS).start()
    yield server
    server.stop()


@pytest.fixture
def instance(server, tmp_path, monkeypatch):
    """The production instance on ``server``, as a role of its own (``claimant``)."""
    role, password = f"claimant_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    with psycopg.connect(server.dsn(), autocommit=True) as connection:
        connection.execute(f"CREATE ROLE {role} LOGIN SUPERUSER PASSWORD '{password}'")
    home, environment = production_instance(server, f"dagster_{role}", tmp_path)
    environment.update(MOSTOVIK_DAGSTER_PG_USER=role, MOSTOVIK_DAGSTER_PG_PASSWORD=password)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with DagsterInstance.from_config(str(home)) as instance:
        _postgres_dsn(instance)
        yield instance, role, password


def refused(instance: DagsterInstance) -> ConfigurationError:
    """Take a claim; the error it fails with, at once."""
    started = time.monotonic()
    with pytest.raises(ConfigurationError) as error, hold_run_claim(instance, "run-r"):
        pass
    assert time.monotonic() - started < 5, "failed at once, not after riding it out"
    return error.value


def test_a_wrong_password_fails_at_once_naming_its_setting(instance, server):
    instance, role, password = instance
    with psycopg.connect(server.dsn(), autocommit=True) as connection:
        connection.execute(f"ALTER ROLE {role} PASSWORD 'changed-by-the-operator'")
    error = refused(instance)
    assert "authentication failed" in str(error)
    assert "MOSTOVIK_DAGSTER_PG_PASSWORD" in str(error) and password not in str(error)
    assert not classify(error.__cause__).transient


def test_a_missing_database_fails_at_once_naming_its_setting(instance, server):
    instance, role, _ = instance
    with psycopg.connect(server.dsn(), autocommit=True) as connection:
        connection.execute(f"DROP DATABASE dagster_{role} WITH (FORCE)")
    error = refused(instance)
    assert "no such database" in str(error) and "MOSTOVIK_DAGSTER_PG_DB" in str(error)


def test_a_bad_connection_option_fails_at_once(instance, monkeypatch):
    instance, _, _ = instance
    url = instance.run_storage.postgres_url
    monkeypatch.setattr(instance.run_storage, "postgres_url",
                        f"{url}?options=-c%20no_such_setting%3D1")
    error = refused(instance)
    assert "a bad setting" in str(error) and "no_such_setting" in str(error)


def test_too_many_clients_fails_at_once(instance, server):
    instance, _, _ = instance
    held = []
    try:
        with pytest.raises(psycopg.OperationalError, match="too many clients"):
            for _ in range(MAX_CONNECTIONS + 1):
                held.append(psycopg.connect(server.dsn()))
        error = refused(instance)
        assert "too many connections" in str(error) and "max_connections" in str(error)
    finally:
        for connection in held:
            connection.close()


def test_the_one_classifier_says_the_same_through_the_warehouse_driver(server):
    """The warehouse's engine wraps the same refusals in SQLAlchemy's errors: the same verdicts
    (a step retries none of the settings' mistakes, and rides out only a stopped server)."""
    wrong = server.url().replace(server.password, "wrong")
    verdicts = {}
    for name, url in {"password": wrong, "database": server.url("no_such_db"),
                      "stopped": server.url().replace(str(server.port), "1")}.items():
        with pytest.raises(sqlalchemy.exc.OperationalError) as error:
            sqlalchemy.create_engine(url).connect()
        verdicts[name] = (classify(error.value).kind, classify(error.value).outage)
    assert verdicts == {"password": ("configuration_error", False),
                        "database": ("configuration_error", False),
                        "stopped": ("database_connection_lost", True)}


def test_the_run_storage_itself_does_not_ride_out_a_wrong_password(instance, server,
                                                                    monkeypatch):
    """Dagster's storage rides out the database being away (platform/instance_storage.py), by
    the same classifier: a wrong password is not the database away, so a process fails to start
    at once instead of after the outage budget."""
    instance, role, _ = instance
    with psycopg.connect(server.dsn(), autocommit=True) as connection:
        connection.execute(f"ALTER ROLE {role} PASSWORD 'changed-by-the-operator'")
    monkeypatch.setenv("MOSTOVIK_DAGSTER_PG_OUTAGE_SECONDS", "60")
    started = time.monotonic()
    with pytest.raises(Exception) as error:
        DagsterInstance.from_config(os.environ["DAGSTER_HOME"]).dispose()
    assert time.monotonic() - started < 30
    causes = []
    cause: BaseException | None = error.value
    while cause is not None:
        causes.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    assert any("password authentication failed" in text for text in causes), causes
