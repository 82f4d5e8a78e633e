"""Security checks: secrets never leave the environment, services bind to 127.0.0.1, and SQL
takes its identifiers from code and its values as bound parameters.

The secrets are real: the warehouse URL of the test PostgreSQL carries its random password, and
an API token and a URL password are given to the source resource through ``EnvVar``. Runs are
made the way operators make them (``dagster job execute``, ``mostovik`` commands, in-process),
including failing ones, and then everything they left is searched: run tags and config, every
event-log entry serialised, the landing store, the whole ``DAGSTER_HOME`` on disk, and the
commands' output.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import psycopg
import pytest
from dagster import DagsterInstance, EnvVar
from dagster._serdes import serialize_value
from sqlalchemy import Column, Integer, MetaData, String, Table, UniqueConstraint, text

from mostovik_pipelines import cli
from mostovik_pipelines.core.load_target import LoadMode, LoadTarget
from mostovik_pipelines.core.outages import Store, setting_of
from mostovik_pipelines.framework.load import sql as load_sql
from mostovik_pipelines.framework.load.partition import load_partition
from mostovik_pipelines.framework.quality.quarantine import quarantined_rows, replace_quarantine
from mostovik_pipelines.framework.spec import RejectedRow
from mostovik_pipelines.resources import HttpSourceResource, WarehouseResource
from mostovik_pipelines.resources.warehouse import warehouse_engine
from mostovik_pipelines.sources import cbr_daily_rates, erp_work_orders
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines.warehouse.schema import BOOKKEEPING_COLUMNS
from mostovik_pipelines_tests.support.locations import FAST_RETRY, code_location_for
from mostovik_pipelines_tests.support.processes import local_dagster_home
from mostovik_pipelines_tests.support.warehouse import table_rows

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HOSTILE = ("x'); DROP TABLE cbr_daily_rates; -- \" ; $$ :run_id %s \\ \t\n\r , "
           "\u202e \u00a0 ' OR '1'='1")


def _leaks(secret: str, *texts: str) -> list[str]:
    return [t[max(0, t.find(secret) - 80): t.find(secret) + 80] for t in texts if secret in t]


def _instance_dump(instance: DagsterInstance) -> list[str]:
    """Every run's tags and config, and every event-log entry of every run, serialised."""
    dumps = []
    for run in instance.get_runs():
        dumps.append(json.dumps({"tags": dict(run.tags), "config": run.run_config}, default=str))
        for record in instance.get_records_for_run(run.run_id, limit=100_000).records:
            dumps.append(serialize_value(record.event_log_entry))
    return dumps


def _files_containing(root: Path, secret: str) -> list[str]:
    needle = secret.encode()
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


# --- secrets ------------------------------------------------------------------------------------


@pytest.fixture
def home(tmp_path) -> Path:
    """A local Dagster instance: the repository's dagster.yaml, storage and compute logs under
    ``tmp_path / "dagster"``."""
    return local_dagster_home(tmp_path)


@pytest.mark.slow
def test_the_database_password_never_leaves_the_environment(
    postgres, pg_warehouse_url, standin_server, standin, home, tmp_path
):
    password = postgres.password
    assert password in pg_warehouse_url
    missing_database = pg_warehouse_url.rsplit("/", 1)[0] + "/no_such_database"
    environment = {
        **os.environ, "DAGSTER_HOME": str(home), "MOSTOVIK_DATABASE_URL": pg_warehouse_url,
        "MOSTOVIK_CBR_URL": standin_server.cbr_url, "MOSTOVIK_DATA_DIR": str(tmp_path / "data"),
        "MOSTOVIK_EXECUTOR": "in_process",
    }

    def command(*args: str, database_url: str = pg_warehouse_url) -> subprocess.CompletedProcess:
        # A database that is not there is away for good: its step's outage budget is seconds.
        away = {setting_of(Store.WAREHOUSE): "3"} if database_url != pg_warehouse_url else {}
        return subprocess.run(
            args, env={**environment, "MOSTOVIK_DATABASE_URL": database_url, **away},
            cwd=tmp_path,
            capture_output=True, text=True, timeout=300,
        )

    def execute(partition: str, database_url: str = pg_warehouse_url):
        return command(str(BIN / "dagster"), "job", "execute", "-m", "mostovik_pipelines",
                       "-j", "cbr_daily_rates_job", "--tags",
                       json.dumps({"dagster/partition": partition}), database_url=database_url)

    standin.fault("status", status=503, match="date_req=06/11/2026")
    completed = [
        command(str(BIN / "mostovik"), "db", "upgrade"),
        execute("2026-11-05"),
        execute("2026-11-06"),  # one transient failure, retried
        execute("2026-11-07", database_url=missing_database),  # fails: no such database
        command(str(BIN / "mostovik"), "materialize", "--source", "cbr_daily_rates",
                "--partition", "2026-11-10"),
        command(str(BIN / "mostovik"), "jobs", "list"),
    ]
    outcomes = [c.returncode for c in completed]
    assert outcomes[:3] == [0, 0, 0] and outcomes[3] != 0 and outcomes[4:] == [0, 0], [
        c.stderr[-2000:] for c in completed]
    with DagsterInstance.from_config(str(home)) as instance:
        runs = instance.get_runs()
        completed.append(command(str(BIN / "mostovik"), "jobs", "show", runs[0].run_id))
        dumps = _instance_dump(instance)
    assert len(runs) == 4
    assert {r.tags["dagster/partition"] for r in runs} >= {"2026-11-05", "2026-11-07"}
    assert any("no_such_database" in d for d in dumps), "the failure should say what failed"
    assert len(table_rows(pg_warehouse_url, "cbr_daily_rates")) == 36

    outputs = [stream for c in completed for stream in (c.stdout, c.stderr)]
    assert _leaks(password, *outputs) == []
    assert _leaks(password, *dumps) == []
    assert _files_containing(home, password) == []
    assert _files_containing(tmp_path / "dagster", password) == []
    assert _files_containing(tmp_path / "data", password) == []


def test_an_api_token_and_a_url_password_never_leave_the_environment(
    pg_warehouse_url, standin_server, standin, tmp_path, monkeypatch
):
    token, url_password = "tok-" + os.urandom(12).hex(), "pw-" + os.urandom(12).hex()
    monkeypatch.setenv("MOSTOVIK_TEST_CBR_TOKEN", token)
    monkeypatch.setenv("MOSTOVIK_TEST_DATABASE_URL", pg_warehouse_url)
    with_credentials = standin_server.cbr_url.replace("http://", f"http://reader:{url_password}@")
    source = dataclasses.replace(cbr_daily_rates.SOURCE, extract_retry=FAST_RETRY)
    location = code_location_for(
        pg_warehouse_url, standin_server, tmp_path, [source],
        warehouse=WarehouseResource(database_url=EnvVar("MOSTOVIK_TEST_DATABASE_URL")),
        cbr_daily_rates_source=HttpSourceResource(
            base_url=with_credentials, token=EnvVar("MOSTOVIK_TEST_CBR_TOKEN"),
            timeout_seconds=2.0),
    )
    job = location.resolve_job_def("cbr_daily_rates_job")
    standin.fault("status", status=503, times=-1, match="date_req=04/11/2026")
    standin.fault("status", status=401, match="date_req=05/11/2026")
    with DagsterInstance.ephemeral() as instance:
        results = [job.execute_in_process(partition_key=p, instance=instance,
                                          raise_on_error=False)
                   for p in ("2026-11-03", "2026-11-04", "2026-11-05")]
        assert [r.success for r in results] == [True, False, False]
        dumps = _instance_dump(instance)
    assert any("HTTP 503 from http://127.0.0.1" in d for d in dumps)
    for secret in (token, url_password, pg_warehouse_url.split(":")[2].split("@")[0]):
        assert _leaks(secret, *dumps) == []
        assert _files_containing(tmp_path, secret) == []


def test_the_erp_token_never_leaves_the_environment(
    pg_warehouse_url, standin_server, standin, tmp_path, monkeypatch
):
    """The sync source's bearer token, through pages, an expired page token, a retry and a
    refused request: it is in the Authorization header and nowhere else."""
    token = "erp-" + os.urandom(12).hex()
    monkeypatch.setenv("MOSTOVIK_TEST_ERP_TOKEN", token)
    standin.reset_erp()
    standin.set_erp_token(token)
    standin.set_erp_volume("2026-11-03", 250)
    source = dataclasses.replace(erp_work_orders.SOURCE, extract_retry=FAST_RETRY)
    location = code_location_for(
        pg_warehouse_url, standin_server, tmp_path, [source],
        erp_work_orders_source=HttpSourceResource(
            base_url=standin_server.erp_url, token=EnvVar("MOSTOVIK_TEST_ERP_TOKEN"),
            timeout_seconds=2.0),
    )
    job = location.resolve_job_def("erp_work_orders_job")
    standin.fault("expire_token", route="erp", page=2, match="updated_from=2026-11-03")
    standin.fault("status", route="erp", status=503, match="updated_from=2026-11-04")
    try:
        with DagsterInstance.ephemeral() as instance:
            results = [job.execute_in_process(partition_key=p, instance=instance,
                                              raise_on_error=False)
                       for p in ("2026-11-03", "2026-11-04")]
            standin.set_erp_token(token + "-rotated")
            refused = job.execute_in_process(partition_key="2026-11-05", instance=instance,
                                             raise_on_error=False)
            dumps = _instance_dump(instance)
    finally:
        standin.reset_erp()
    assert [r.success for r in results] == [True, True] and not refused.success
    assert any("HTTP 401" in d for d in dumps)
    assert _leaks(token, *dumps) == []
    assert _files_containing(tmp_path, token) == []


# --- listening addresses ------------------------------------------------------------------------


def test_the_stand_in_binds_to_loopback_by_default():
    assert inspect.signature(StandinServer).parameters["host"].default == "127.0.0.1"
    host_option = next(p for p in cli.standin.params if p.name == "host")
    assert host_option.default == "127.0.0.1"
    server = StandinServer()
    try:
        assert server.httpd.server_address[0] == "127.0.0.1"
    finally:
        server.httpd.server_close()


def test_make_dev_binds_the_ui_and_the_stand_in_to_loopback():
    makefile = (REPO / "Makefile").read_text()
    dev = makefile.split("\ndev:", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"dagster dev -h 127\.0\.0\.1\b", dev), dev
    assert "mostovik standin" in dev
    assert "--host" not in dev or "--host 127.0.0.1" in dev
    assert "0.0.0.0" not in makefile


def test_the_test_postgresql_listens_on_loopback_only(postgres):
    with psycopg.connect(postgres.dsn()) as connection:
        assert connection.execute("SHOW listen_addresses").fetchone()[0] == "127.0.0.1"


# --- SQL: identifiers from code, values bound -----------------------------------------------


def test_sql_builders_take_identifiers_only_and_quote_them():
    """No builder receives a value: every parameter is a dialect, a table or column names, or a
    keyword-only flag that picks between two fixed texts (``if_exists``)."""
    identifier_parameters = {"dialect", "table", "stage", "natural_key", "data_columns",
                             "columns", "version_column", "partition_column", "table_name",
                             "kept", "tombstone_column"}
    builders = [f for name, f in inspect.getmembers(load_sql, inspect.isfunction)
                if f.__module__ == load_sql.__name__ and not name.startswith("_")]
    assert builders
    for builder in builders:
        parameters = inspect.signature(builder).parameters
        flags = {name for name, p in parameters.items()
                 if p.kind is p.KEYWORD_ONLY and p.annotation == "bool"}
        assert set(parameters) - flags <= identifier_parameters, builder
    hostile = Table('rates"; DROP TABLE x; --', MetaData(),
                    Column('key" OR 1=1 --', String), Column("part", String),
                    Column("va'lue", String))
    from sqlalchemy.dialects import postgresql

    dialect = postgresql.dialect()
    sql = load_sql.update_changed_rows(dialect, hostile, hostile, ['key" OR 1=1 --'],
                                       ['key" OR 1=1 --', "va'lue"])
    assert '"rates""; DROP TABLE x; --"' in sql and '"key"" OR 1=1 --"' in sql


def test_hostile_strings_in_every_text_column_round_trip_as_data(warehouse_url):
    """Through the real loader (COPY on PostgreSQL, bound inserts on SQLite) into a table whose
    own name and column names are hostile too, and through the quarantine."""
    metadata = MetaData()
    table = Table(
        'hostile "rates"; --', metadata,
        Column("part", String(16), nullable=False),
        Column('code" OR 1=1', String(64), nullable=False),
        Column("na'me", String(255)),
        Column("n", Integer),
        *(Column(c, String(64)) for c in BOOKKEEPING_COLUMNS),
        UniqueConstraint("part", 'code" OR 1=1'),
    )
    engine = warehouse_engine(warehouse_url)
    metadata.create_all(engine)
    target = LoadTarget(table, ("part", 'code" OR 1=1'), "part", LoadMode.REPLACE_PARTITION)
    values = [HOSTILE, "", "NULL", "\\N", '"', "'", ",", "\\", "-- x", "%(x)s", ":now"]
    frame = pd.DataFrame({
        "part": ["p1"] * len(values),
        'code" OR 1=1': [f"{i}{v}"[:64] for i, v in enumerate(values)],
        "na'me": values, "n": range(len(values)),
    })
    first = load_partition(engine, target, frame, "p1", "run-1")
    again = load_partition(engine, target, frame, "p1", "run-2")
    assert (first.inserted, again.unchanged, again.written) == (len(values), len(values), 0)
    with engine.connect() as connection:
        stored = connection.execute(table.select().order_by(table.c.n)).fetchall()
        assert connection.execute(text("SELECT count(*) FROM quarantined_rows")).scalar() == 0
    assert [row._mapping["na'me"] for row in stored] == values

    rejected = [RejectedRow(1, HOSTILE, HOSTILE), RejectedRow(2, "\\N", "NULL")]
    replace_quarantine(engine, HOSTILE, HOSTILE, HOSTILE[:64], rejected)
    with engine.connect() as connection:
        kept = connection.execute(quarantined_rows.select().order_by(
            quarantined_rows.c.row_number)).fetchall()
    assert [(r.source, r.partition_key, r.raw_row, r.reason) for r in kept] == [
        (HOSTILE, HOSTILE, HOSTILE, HOSTILE), (HOSTILE, HOSTILE, "\\N", "NULL")]
    with engine.connect() as connection:  # the warehouse's own tables are intact
        assert connection.execute(text("SELECT count(*) FROM cbr_daily_rates")).scalar() == 0
