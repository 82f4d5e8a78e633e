"""The production instance config (deploy/dagster.yaml) on real PostgreSQL storage, driven the
way CI and operators drive it: ``dagster job execute`` in a process of its own."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
import sqlalchemy
from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetKey,
    DagsterInstance,
    DagsterRunStatus,
    RunsFilter,
)

from mostovik_pipelines.core import outages
from mostovik_pipelines.core.outages import Store, setting_of
from mostovik_pipelines.platform import instance_storage
from mostovik_pipelines.platform.claims import KEEPER_CHECK_SECONDS, RETAKE_GRACE_SECONDS
from mostovik_pipelines.platform.instance_storage import _ping_on_checkout, storage_engine
from mostovik_pipelines_tests.support.instances import production_instance
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres, backend_waiting_on_a_lock
from mostovik_pipelines_tests.support.waiting import (
    PROCESS_START_MARGIN_SECONDS,
    wait_for_hanging_request,
    wait_until,
)
from mostovik_pipelines_tests.support.warehouse import table_rows

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_dagster_job_execute_records_the_run_in_postgres_run_storage(
    production_home, postgres, pg_warehouse_url, standin_server, standin, tmp_path, monkeypatch
):
    home, environment = production_home
    environment |= {
        "MOSTOVIK_DATABASE_URL": pg_warehouse_url,
        "MOSTOVIK_CBR_URL": standin_server.cbr_url,
        "MOSTOVIK_DATA_DIR": str(tmp_path / "data"),
    }
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with DagsterInstance.from_config(str(home)):
        pass  # the instance's tables created, as on a deployed database
    sessions_before = _sessions(postgres, environment["MOSTOVIK_DAGSTER_PG_DB"])
    completed = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "job", "execute",
         "-m", "mostovik_pipelines", "-j", "cbr_daily_rates_job",
         "--tags", json.dumps({"dagster/partition": "2026-11-02"})],
        env={**os.environ, **environment}, cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    # The instance storage keeps its connections (instance_storage.PooledPostgresStorage):
    # dagster-postgres alone opened one per storage call, ~100 for this run.
    opened = _sessions(postgres, environment["MOSTOVIK_DAGSTER_PG_DB"]) - sessions_before
    print(f"dagster job execute opened {opened} sessions on the instance database")
    assert 0 < opened <= 20, f"the run opened {opened} sessions on the instance database"

    with DagsterInstance.from_config(str(home)) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.get_ref().storage).__name__ == "PooledPostgresStorage"
        runs = instance.get_runs(RunsFilter(job_name="cbr_daily_rates_job"))
        assert len(runs) == 1
        assert runs[0].status == DagsterRunStatus.SUCCESS
        assert runs[0].tags["dagster/partition"] == "2026-11-02"
        assert runs[0].tags["mostovik/source"] == "cbr_daily_rates"
        assert runs[0].tags["mostovik/job_type"] == "parser"
    assert len(table_rows(pg_warehouse_url, "cbr_daily_rates")) == 12


RESTART_PARTITION = "2026-11-03"
RUN_STORAGE_DOWN_SECONDS = 60
"""The promised bound: a fault that passes within a minute is ridden out."""


@pytest.mark.slow
@pytest.mark.long_outage
def test_a_run_storage_restart_under_a_live_run_is_ridden_out_and_lets_no_duplicate_in(
    postgres, pg_warehouse_url, standin_server, standin, tmp_path, monkeypatch
):
    """The run storage's PostgreSQL crashes (``pg_ctl -m immediate``) while a run waits on a
    slow source and is back 60 s later; a second run of the partition is started at once: the
    first run takes its claim again and finishes, the second waits for it, the table is one
    clean load's."""
    run_storage = ThrowawayPostgres().start()
    try:
        home, env = _slow_source_run_environment(
            run_storage, "dagster_restarted", pg_warehouse_url, standin_server, tmp_path,
            monkeypatch, source_timeout_seconds=5 * RUN_STORAGE_DOWN_SECONDS)
        with DagsterInstance.from_config(str(home)) as instance:
            # What the outage handling hooks into: dagster-postgres' private engine, kept.
            for storage in (instance.run_storage, instance.event_log_storage,
                            instance.schedule_storage):
                engine = storage_engine(storage)
                assert isinstance(engine, sqlalchemy.engine.Engine)
                assert sqlalchemy.event.contains(engine, "checkout", _ping_on_checkout)
        match = "date_req=03/11/2026"
        standin.fault("hang", seconds=300, match=match)
        first = _execute(env, tmp_path, case="first")
        wait_for_hanging_request(standin, match)
        run_storage.down_for(RUN_STORAGE_DOWN_SECONDS)
        second = _execute(env, tmp_path, case="second")
        with DagsterInstance.from_config(str(home)) as instance:
            wait_until(lambda: _logged(instance, "second", "waiting for run(s)"),
                       PROCESS_START_MARGIN_SECONDS + RETAKE_GRACE_SECONDS,
                       "the second run waiting for the first",
                       lambda: _runs_and_logs(instance, {"first": first, "second": second}))
        standin.release_hangs()
        outputs = [process.communicate(timeout=300)[0] for process in (first, second)]
        assert [first.returncode, second.returncode] == [0, 0], outputs[0][-3000:]
        with DagsterInstance.from_config(str(home)) as instance:
            (older,) = instance.get_runs(RunsFilter(tags={"mostovik_test/case": "first"}))
            (younger,) = instance.get_runs(RunsFilter(tags={"mostovik_test/case": "second"}))
            assert older.status == younger.status == DagsterRunStatus.SUCCESS
            assert _logged(instance, "second", f"waiting for run(s) {older.run_id}")
    finally:
        run_storage.stop()
    rows = [r for r in table_rows(pg_warehouse_url, "cbr_daily_rates")
            if str(r["partition_date"]) == RESTART_PARTITION]
    assert len(rows) == 12


def test_a_storage_call_cut_off_in_flight_is_made_again_and_answers(
    production_home, postgres, monkeypatch
):
    """The connection a run-storage call is using dies while the statement runs (here: the
    call waits on a lock an operator holds and its backend is terminated, as a restart cuts off
    the statement a process is in): the call is made again on a new connection and answers,
    in this process and in a webserver's, whose storage engines are its own."""
    home, environment = production_home
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    database = environment["MOSTOVIK_DAGSTER_PG_DB"]
    with DagsterInstance.from_config(str(home)) as instance:
        for webserver in (False, True):
            if webserver:
                instance.optimize_for_webserver(statement_timeout=30_000, pool_recycle=3600,
                                                max_overflow=5)
            run = instance.create_run_for_job(_empty_job(), run_id=None)
            with psycopg.connect(postgres.dsn(database), autocommit=True) as operator:
                operator.execute("BEGIN")
                operator.execute("LOCK TABLE runs IN ACCESS EXCLUSIVE MODE")
                answer: dict[str, object] = {}
                reader = threading.Thread(target=_read_run, args=(instance, run.run_id, answer))
                reader.start()
                pid = backend_waiting_on_a_lock(operator, "%")
                assert pid is not None, "the storage call never waited on the lock"
                operator.execute("SELECT pg_terminate_backend(%s)", (pid,))
                operator.execute("COMMIT")
                reader.join(timeout=60)
            assert answer.get("run") is not None and answer["run"].run_id == run.run_id, (
                webserver, answer)


def test_a_kept_connection_that_died_since_its_last_call_is_replaced_and_the_call_answers(
    production_home, postgres, monkeypatch, caplog
):
    """A connection returned a moment ago is used without a ping (a run logs its events back to
    back). When the database ended it meanwhile (a restart between two events), the call that
    finds it dead is made again on a new connection and answers. The idle limit is raised here
    so that no ping can hide the dead connection, whatever the machine's speed."""
    home, environment = production_home
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(instance_storage, "IDLE_BEFORE_PING_SECONDS", 3600.0)
    database = environment["MOSTOVIK_DAGSTER_PG_DB"]
    with DagsterInstance.from_config(str(home)) as instance:
        run = instance.create_run_for_job(_empty_job(), run_id=None)
        assert instance.get_run_by_id(run.run_id) is not None  # the kept connection, returned
        with psycopg.connect(postgres.dsn(database), autocommit=True) as operator:
            ended = operator.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()", (database,)).fetchone()[0]
        assert ended >= 1, "the instance kept no connection to end"
        with caplog.at_level(logging.WARNING, logger=outages.__name__):
            assert instance.get_run_by_id(run.run_id).run_id == run.run_id
    assert any("the run storage database away" in r.getMessage() for r in caplog.records)


def test_storing_check_results_asks_for_the_check_table_once(production_home, monkeypatch):
    """Dagster asks whether the check-executions table exists before it stores each check
    result; the instance asks the database once and keeps the answer (four results per
    partition of a ranged run made it a catalog query each)."""
    home, environment = production_home
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with DagsterInstance.from_config(str(home)) as instance:
        catalog_queries = []
        sqlalchemy.event.listen(
            storage_engine(instance.event_log_storage), "before_cursor_execute",
            lambda conn, cursor, statement, *rest: catalog_queries.append(statement)
            if "pg_class" in statement else None)
        for partition in ("2026-11-02", "2026-11-03", "2026-11-04"):
            for check in ("natural_key_unique", "rows_in_partition"):
                instance.report_runless_asset_event(AssetCheckEvaluation(
                    asset_key=AssetKey("cbr_daily_rates"), check_name=check, passed=True,
                    partition=partition))
        assert len(catalog_queries) <= 1, catalog_queries
        stored = instance.event_log_storage.get_asset_check_execution_history(
            AssetCheckKey(AssetKey("cbr_daily_rates"), "natural_key_unique"), limit=10)
        assert len(stored) == 3


STARTING_DOWN_SECONDS = 20  # dagster-postgres alone retries for about 6 s


def test_an_instance_started_while_its_run_storage_is_away_waits_for_it(tmp_path, monkeypatch):
    """A process that builds the instance while its PostgreSQL restarts (a code server the
    daemon starts again, a run, a webserver) waits for the database and answers, instead of
    failing to load: dagster-postgres alone gives up after about 6 s, and a daemon's code
    location that failed to load fails every backfill it evaluates meanwhile."""
    server = ThrowawayPostgres().start()
    try:
        home, environment = production_instance(server, "dagster_starting", tmp_path)
        for name, value in environment.items():
            monkeypatch.setenv(name, value)
        with DagsterInstance.from_config(str(home)):
            pass  # the instance's tables created, as on a deployed database
        server.pause()
        back = threading.Timer(STARTING_DOWN_SECONDS, server.resume)
        back.start()
        started = time.monotonic()
        try:
            with DagsterInstance.from_config(str(home)) as instance:
                waited = time.monotonic() - started
                assert instance.get_runs() == []
        finally:
            back.join()
        assert waited >= STARTING_DOWN_SECONDS - 1, f"built in {waited:.1f} s, database away"
    finally:
        server.stop()


PAST_BUDGET_PARTITION = "2026-11-04"


@pytest.mark.slow
@pytest.mark.long_outage
def test_a_run_storage_away_past_the_90_s_budget_under_a_live_run_fails_it_writing_nothing(
    pg_warehouse_url, standin_server, standin, tmp_path, monkeypatch
):
    """The run storage crashes while a run waits on a slow source and stays away past the 90 s
    a run rides out (the deployment's own budgets, none shortened): the run's process gives up,
    naming the run storage and the setting; it wrote nothing to the warehouse; once the
    database is back, a re-run of the partition loads it exactly."""
    run_storage = ThrowawayPostgres().start()
    try:
        for budget in (instance_storage.OUTAGE_ENV, setting_of(Store.WAREHOUSE)):
            monkeypatch.delenv(budget, raising=False)
        home, env = _slow_source_run_environment(
            run_storage, "dagster_past_budget", pg_warehouse_url, standin_server, tmp_path,
            monkeypatch, source_timeout_seconds=300)
        with DagsterInstance.from_config(str(home)):
            pass  # the instance's tables created, as on a deployed database
        match = "date_req=04/11/2026"
        standin.fault("hang", seconds=300, match=match)
        first = _execute(env, tmp_path, case="past-budget", partition=PAST_BUDGET_PARTITION)
        wait_for_hanging_request(standin, match)
        run_storage.pause()
        away_since = time.monotonic()
        try:
            standin.release_hangs()
            output = first.communicate(timeout=400)[0]
            gave_up_after = time.monotonic() - away_since
        finally:
            run_storage.resume()
        print(f"the run gave up {gave_up_after:.1f} s into the outage")
        assert first.returncode != 0
        budget = instance_storage.DEFAULT_OUTAGE_SECONDS
        assert f"past the {budget:.0f} s a run rides out ({instance_storage.OUTAGE_ENV})" in (
            output), output[-3000:]
        assert run_storage.password not in output
        # The outage counts from when the database last answered the run (its claim's keeper
        # looks every KEEPER_CHECK_SECONDS), which can be just before it went away.
        assert budget - KEEPER_CHECK_SECONDS - 1 <= gave_up_after <= budget + 30
        assert [r for r in table_rows(pg_warehouse_url, "cbr_daily_rates")
                if str(r["partition_date"]) == PAST_BUDGET_PARTITION] == []

        rerun = _execute(env, tmp_path, case="past-budget-rerun", partition=PAST_BUDGET_PARTITION)
        rerun_output = rerun.communicate(timeout=300)[0]
        assert rerun.returncode == 0, rerun_output[-3000:]
        with DagsterInstance.from_config(str(home)) as instance:
            (again,) = instance.get_runs(
                RunsFilter(tags={"mostovik_test/case": "past-budget-rerun"}))
            assert again.status == DagsterRunStatus.SUCCESS
    finally:
        run_storage.stop()
    rows = [r for r in table_rows(pg_warehouse_url, "cbr_daily_rates")
            if str(r["partition_date"]) == PAST_BUDGET_PARTITION]
    assert len(rows) == 12


def _slow_source_run_environment(run_storage: ThrowawayPostgres, database: str,
                                 warehouse_url: str, standin_server, tmp_path: Path,
                                 monkeypatch, source_timeout_seconds: float
                                 ) -> tuple[Path, dict[str, str]]:
    """A production instance on ``run_storage`` (its own server, so it can go away while the
    warehouse stays up) and the environment of a run whose source answers only when released
    after the outage: its fetch must not time out (30 s by default) and be retried within it."""
    home, environment = production_instance(run_storage, database, tmp_path)
    environment |= {
        "MOSTOVIK_DATABASE_URL": warehouse_url,
        "MOSTOVIK_CBR_URL": standin_server.cbr_url,
        "MOSTOVIK_CBR_TIMEOUT_SECONDS": str(source_timeout_seconds),
        "MOSTOVIK_DATA_DIR": str(tmp_path / "data"),
    }
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    return home, dict(os.environ)


def _read_run(instance: DagsterInstance, run_id: str, answer: dict) -> None:
    try:
        answer["run"] = instance.get_run_by_id(run_id)
    except Exception as error:  # shown by the assertion
        answer["error"] = error


def _empty_job():
    from dagster import job, op

    @op
    def nothing() -> None:
        pass

    @job
    def empty():
        nothing()

    return empty


def _execute(env: dict[str, str], cwd: Path, case: str,
             partition: str = RESTART_PARTITION) -> subprocess.Popen:
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "dagster"), "job", "execute",
         "-m", "mostovik_pipelines", "-j", "cbr_daily_rates_job",
         "--tags", json.dumps({"dagster/partition": partition,
                               "mostovik_test/case": case})],
        env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _runs_and_logs(instance: DagsterInstance, processes: dict[str, subprocess.Popen]) -> str:
    """Each case's runs, their status and last messages, and the output of any that ended."""
    lines = []
    for case, process in processes.items():
        for run in instance.get_runs(RunsFilter(tags={"mostovik_test/case": case})):
            messages = [record.user_message or "" for record in instance.all_logs(run.run_id)]
            lines.append(f"{case} {run.run_id} {run.status.value}: {messages[-8:]}")
        if process.poll() is not None:
            lines.append(f"{case} exited {process.returncode}:\n{process.stdout.read()[-3000:]}")
    return "\n".join(lines)


def _logged(instance: DagsterInstance, case: str, text: str) -> bool:
    return any(text in (record.user_message or "")
               for run in instance.get_runs(RunsFilter(tags={"mostovik_test/case": case}))
               for record in instance.all_logs(run.run_id))


def _sessions(postgres, database: str) -> int:
    """Sessions ever established on ``database`` (PostgreSQL counts one as its backend ends)."""
    with psycopg.connect(postgres.dsn(), autocommit=True) as connection:
        time.sleep(1.5)  # a backend reports its counters when it exits, within a second
        return int(connection.execute(
            "SELECT coalesce(sessions, 0) FROM pg_stat_database WHERE datname = %s",
            (database,)).fetchone()[0])
