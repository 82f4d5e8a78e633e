"""``mostovik verify`` as an operator types it, on a deployment that loaded a month of the CBR's
rates, a day's ERP window and a delivery report (PostgreSQL warehouse and run storage, the
landing store on disk): a clean range exits 0, hand edits (a row changed, a row deleted, a row
added) are named against the payload ``landed`` and the ``source``, and a correction the source
made after the load against the ``source`` only; nothing is written to either database or the
landing store."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from unittest import mock
from zoneinfo import ZoneInfo

import psycopg
import pytest
from dagster import DagsterInstance

from mostovik_pipelines.core.tags import RANGE_END_TAG, RANGE_START_TAG
from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines.standin import StandinClient
from mostovik_pipelines_tests.support import delivery_reports as reports
from mostovik_pipelines_tests.support.inbox import InboxSensor, drop, inbox_dirs, inbox_resource
from mostovik_pipelines_tests.support.instances import create_instance_storage, fresh_deployment
from mostovik_pipelines_tests.support.locations import code_location_for

MOSTOVIK = str(Path(sys.executable).parent / "mostovik")
MOSCOW = ZoneInfo("Europe/Moscow")
MONTH = ("2026-10-01", "2026-10-31")
WINDOW = "2026-11-10"
REPORT = "verify_site.csv"


@dataclass(frozen=True)
class Deployment:
    home: Path
    env: dict[str, str]
    work: Path
    version: str
    """The delivery report's loaded version."""
    lines: list

    @property
    def warehouse(self) -> str:
        return self.env["MOSTOVIK_DATABASE_URL"].replace("+psycopg", "")

    @property
    def run_storage(self) -> str:
        e = self.env
        return (f"postgresql://{e['MOSTOVIK_DAGSTER_PG_USER']}:"
                f"{e['MOSTOVIK_DAGSTER_PG_PASSWORD']}@{e['MOSTOVIK_DAGSTER_PG_HOST']}:"
                f"{e['MOSTOVIK_DAGSTER_PG_PORT']}/{e['MOSTOVIK_DAGSTER_PG_DB']}")


@pytest.fixture(scope="module")
def deployment(postgres, standin_server, tmp_path_factory) -> Iterator[Deployment]:
    work = tmp_path_factory.mktemp("verify")
    inbox, archive = inbox_dirs(work)
    with fresh_deployment(postgres, standin_server, work, "verify") as (home, env):
        env.update({"MOSTOVIK_LANDING_DIR": str(work / "landing"),
                    "MOSTOVIK_STORAGE_DIR": str(work / "storage"),
                    "MOSTOVIK_INBOX_DIR": str(inbox), "MOSTOVIK_ARCHIVE_DIR": str(archive),
                    "MOSTOVIK_CBR_METALS_URL": standin_server.endpoint_url("cbr_metal_prices")})
        create_instance_storage(home, env)
        StandinClient(standin_server.url).reset_erp()
        location = code_location_for(env["MOSTOVIK_DATABASE_URL"], standin_server, work,
                                     ALL_SOURCES)
        with mock.patch.dict(os.environ, env), DagsterInstance.from_config(str(home)) as instance:
            assert location.resolve_job_def("cbr_daily_rates_job").execute_in_process(
                instance=instance, tags={RANGE_START_TAG: MONTH[0], RANGE_END_TAG: MONTH[1]},
            ).success
            assert location.resolve_job_def("erp_work_orders_job").execute_in_process(
                instance=instance, partition_key=WINDOW).success
            lines = reports.deliveries(6, seed=60)
            version = drop(inbox, REPORT, reports.csv_report(reports.report_table(lines)))
            runs = InboxSensor(location, instance, inbox_resource(work)).run_new_versions()
            assert [result.success for result in runs.values()] == [True]
        yield Deployment(home, env, work, version, lines)


def verify(deployment: Deployment, source: str, first: str, last: str, against: str,
           ) -> tuple[int, dict]:
    done = subprocess.run(
        [MOSTOVIK, "verify", "--source", source, "--from", first, "--to", last, "--against",
         against, "--json"],
        env={**os.environ, **deployment.env}, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout)


def database_contents(url: str) -> dict[str, str]:
    """Every table's rows with their physical identity (a rewritten row changes it), hashed."""
    with psycopg.connect(url) as connection:
        tables = [row[0] for row in connection.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
        return {table: connection.execute(
            f'SELECT md5(coalesce(string_agg(t.ctid::text || t.xmin::text || t::text, \'|\' '
            f'ORDER BY t.ctid), \'\')) FROM "{table}" t').fetchone()[0] for table in tables}


def store_contents(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


def snapshot(deployment: Deployment) -> tuple:
    return (database_contents(deployment.warehouse), database_contents(deployment.run_storage),
            store_contents(deployment.work / "landing"), store_contents(deployment.work / "inbox"),
            store_contents(deployment.work / "archive"))


def execute(deployment: Deployment, *statements: str) -> None:
    with psycopg.connect(deployment.warehouse, autocommit=True) as connection:
        for statement in statements:
            connection.execute(statement)


def named(report: dict) -> dict[str, dict]:
    """Per partition that does not agree: its missing and extra keys and differing values."""
    return {p["partition_key"]: {
        "missing": p["missing"], "extra": p["extra"],
        "differing": [(d["key"], d["column"], d["stored"], d["source"]) for d in p["differing"]]}
        for p in report["partitions"] if not p["agrees"]}


BOOKKEEPING = "'by-hand', now(), 'by-hand', now()"


def stored(deployment: Deployment, sql: str):
    with psycopg.connect(deployment.warehouse) as connection:
        return connection.execute(sql).fetchone()[0]


def test_a_clean_range_matches_on_every_source_kind_and_nothing_is_written(
        deployment, standin_server):
    standin = StandinClient(standin_server.url)
    standin.forget_requests()
    before = snapshot(deployment)
    for source, first, last in (("cbr_daily_rates", *MONTH),
                                ("erp_work_orders", WINDOW, WINDOW),
                                ("material_deliveries", deployment.version, deployment.version)):
        for against in ("landed", "source"):
            code, report = verify(deployment, source, first, last, against)
            assert (code, report["agrees"]) == (0, True), (source, against, named(report))
            assert {p["status"] for p in report["partitions"]} == {"matches"}
        assert report["partitions"][0]["source_rows"] > 0
    assert len(report["partitions"]) == 1
    shown = subprocess.run(
        [MOSTOVIK, "verify", "--source", "cbr_daily_rates", "--from", MONTH[0], "--to",
         MONTH[0], "--against", "landed"], env={**os.environ, **deployment.env},
        capture_output=True, text=True, timeout=300)
    assert (shown.returncode, shown.stdout.splitlines()) == (0, [
        f"{MONTH[0]}: matches",
        "cbr_daily_rates: 1 partition(s) against the landed payloads: 1 match, 0 do not"])
    # Against the landed payload no request leaves the machine; against the source, one per
    # partition (the ERP's window: its pages).
    assert len(standin.requests("cbr")) == 31
    assert len(standin.requests("erp")) >= 1
    assert snapshot(deployment) == before


def test_hand_edits_and_a_correction_at_the_source_are_each_named(deployment, standin_server):
    usd = stored(deployment, "SELECT value FROM cbr_daily_rates "
                             "WHERE partition_date = '2026-10-05' AND char_code = 'USD'")
    cny = stored(deployment, "SELECT value FROM cbr_daily_rates "
                             "WHERE partition_date = '2026-10-08' AND char_code = 'CNY'")
    execute(
        deployment,
        "UPDATE cbr_daily_rates SET value = 1.2345 "
        "WHERE partition_date = '2026-10-05' AND char_code = 'USD'",
        "DELETE FROM cbr_daily_rates WHERE partition_date = '2026-10-06' AND char_code = 'EUR'",
        "INSERT INTO cbr_daily_rates SELECT partition_date, rate_date, 'R09999', '999', 'XXX', "
        f"1, 'Hand-made', 1.0, 1.0, {BOOKKEEPING} FROM cbr_daily_rates "
        "WHERE partition_date = '2026-10-07' LIMIT 1")
    standin = StandinClient(standin_server.url)
    standin.change_cbr_rates("2026-10-08", {"CNY": "13,1234"})
    try:
        before = snapshot(deployment)
        landed_code, landed = verify(deployment, "cbr_daily_rates", *MONTH, "landed")
        source_code, source = verify(deployment, "cbr_daily_rates", *MONTH, "source")
        assert snapshot(deployment) == before
    finally:
        standin.reset_cbr_rates()
    hand_edits = {
        "2026-10-05": {"missing": [], "extra": [], "differing": [
            ({"partition_date": "2026-10-05", "char_code": "USD"}, "value", "1.2345",
             format(usd, "f"))]},
        "2026-10-06": {"missing": [{"partition_date": "2026-10-06", "char_code": "EUR"}],
                       "extra": [], "differing": []},
        "2026-10-07": {"missing": [], "extra": [{"partition_date": "2026-10-07",
                                                 "char_code": "XXX"}], "differing": []},
    }
    assert (landed_code, named(landed)) == (1, hand_edits)
    correction = named(source).pop("2026-10-08")
    cny_key = {"partition_date": "2026-10-08", "char_code": "CNY"}
    assert correction["differing"][0] == (cny_key, "value", format(cny, "f"), "13.1234")
    assert [(d[0], d[1], d[3]) for d in correction["differing"][1:]] == [
        (cny_key, "unit_rate", "13.1234")]
    assert source_code == 1
    assert {k: v for k, v in named(source).items() if k != "2026-10-08"} == hand_edits


def test_the_same_on_a_sync_window(deployment, standin_server):
    with psycopg.connect(deployment.warehouse) as connection:
        ids = [row[0] for row in connection.execute(
            "SELECT id FROM erp_work_orders WHERE window_date = %s ORDER BY id LIMIT 3",
            (WINDOW,))]
    edited, deleted, corrected = ids
    execute(
        deployment,
        f"UPDATE erp_work_orders SET amount = 0.01 WHERE id = '{edited}'",
        f"DELETE FROM erp_work_orders WHERE id = '{deleted}'",
        "INSERT INTO erp_work_orders SELECT 'WO-BY-HAND', object_code, title, status, "
        "planned_start, planned_finish, amount, updated_at, version, deleted, window_date, "
        f"{BOOKKEEPING} FROM erp_work_orders WHERE id = '{edited}'")
    standin = StandinClient(standin_server.url)
    standin.update_erp_work_order(corrected, datetime(2026, 11, 10, 23, 30, tzinfo=MOSCOW),
                                  amount="4242.42")
    try:
        before = snapshot(deployment)
        landed_code, landed = verify(deployment, "erp_work_orders", WINDOW, WINDOW, "landed")
        source_code, source = verify(deployment, "erp_work_orders", WINDOW, WINDOW, "source")
        assert snapshot(deployment) == before
    finally:
        standin.reset_erp()
    found = named(landed)[WINDOW]
    assert found["missing"] == [{"id": deleted}]
    assert found["extra"] == [{"id": "WO-BY-HAND"}]
    assert [(d[0], d[1], d[2]) for d in found["differing"]] == [({"id": edited}, "amount", "0.01")]
    assert landed_code == 1
    found = named(source)[WINDOW]
    assert (source_code, found["missing"], found["extra"]) == (1, [{"id": deleted}],
                                                               [{"id": "WO-BY-HAND"}])
    changed = {(d[0]["id"], d[1]) for d in found["differing"]}
    assert {(edited, "amount"), (corrected, "amount"), (corrected, "version"),
            (corrected, "updated_at")} <= changed
    assert ({key for key, _ in changed}) == {edited, corrected}


def test_the_same_on_a_file_version(deployment):
    lines = deployment.lines
    first, second = lines[0], lines[1]
    execute(
        deployment,
        f"UPDATE material_deliveries SET price = 0.99 WHERE waybill = '{first.waybill}' "
        f"AND line_no = {first.line_no}",
        f"DELETE FROM material_deliveries WHERE waybill = '{second.waybill}' "
        f"AND line_no = {second.line_no}",
        "INSERT INTO material_deliveries SELECT delivery_date, object_code, 'BY-HAND', 1, "
        "material, unit, quantity, price, supplier, source_file, file_version, "
        f"{BOOKKEEPING} FROM material_deliveries WHERE source_file = '{REPORT}' LIMIT 1")
    # The site sends a corrected report under the same name (not loaded yet).
    corrected = [*lines[:2], lines[2].__class__(**{**lines[2].__dict__, "quantity":
                                                   lines[2].quantity + 1}), *lines[3:]]
    inbox, _ = inbox_dirs(deployment.work)
    newer = drop(inbox, REPORT, reports.csv_report(reports.report_table(corrected)))
    try:
        before = snapshot(deployment)
        landed_code, landed = verify(deployment, "material_deliveries", deployment.version,
                                     deployment.version, "landed")
        source_code, source = verify(deployment, "material_deliveries", deployment.version,
                                     deployment.version, "source")
        assert snapshot(deployment) == before
    finally:
        (inbox / REPORT).unlink()
    key = {"waybill": first.waybill, "line_no": str(first.line_no)}
    expected = {"missing": [{"waybill": second.waybill, "line_no": str(second.line_no)}],
                "extra": [{"waybill": "BY-HAND", "line_no": "1"}],
                "differing": [(key, "price", "0.99", str(first.price))]}
    assert (landed_code, named(landed)) == (1, {deployment.version: expected})
    found = named(source)[deployment.version]
    assert found.pop("differing")[-1] == (
        {"waybill": lines[2].waybill, "line_no": str(lines[2].line_no)}, "quantity",
        str(lines[2].quantity), str(lines[2].quantity + 1))
    assert source_code == 1
    assert found == {k: v for k, v in expected.items() if k != "differing"}
    assert source["partitions"][0]["note"] == (
        f"the source holds a newer version, {newer}, not loaded")
