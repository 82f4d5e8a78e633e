"""``mostovik tracker rebuild`` after run storage was lost: a deployment (PostgreSQL warehouse
and run storage) loads two weeks of every source; its run-storage database is dropped and
created empty; the rebuild, from the warehouse's ledger alone, brings back what the UI shows
materialised (over the webserver's GraphQL), what the catch-up asks for, the loading runs in
``mostovik jobs list``, and records nothing the second time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from unittest import mock
from zoneinfo import ZoneInfo

import psycopg
from dagster import DagsterInstance, TimeWindowPartitionsDefinition, build_schedule_context

from mostovik_pipelines.core.tags import (
    RANGE_END_TAG,
    RANGE_START_TAG,
    REQUESTED_BECAUSE_TAG,
)
from mostovik_pipelines.framework.automation.catch_up import (
    Reason,
    file_versions_to_retry,
    plan_catch_up,
)
from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines.standin import StandinClient
from mostovik_pipelines_tests.support import delivery_reports as reports
from mostovik_pipelines_tests.support.inbox import (
    InboxSensor,
    drop,
    inbox_dirs,
    inbox_resource,
    renumbered,
)
from mostovik_pipelines_tests.support.instances import create_instance_storage, fresh_deployment
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.webserver import DagsterServices

MOSTOVIK = str(Path(sys.executable).parent / "mostovik")
DAYS = 14


def mostovik(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([MOSTOVIK, *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def two_weeks(spec) -> list[str]:
    """The source's last two weeks of days, today's included (not tomorrow's)."""
    keys = spec.partitions_def.get_partition_keys()
    today = datetime.now(ZoneInfo(spec.partitions_def.timezone)).date().isoformat()
    return [key for key in keys if key <= today][-DAYS:]


def shown_materialised(services: DagsterServices, instance: DagsterInstance) -> dict[str, list]:
    return {spec.name: services.graphql.materialized_partitions(
        spec.name, spec.partitions_def.get_partition_keys(dynamic_partitions_store=instance))
        for spec in ALL_SOURCES}


def catch_up(location, instance: DagsterInstance, now: datetime) -> dict[str, list]:
    """What each source's automation asks for at ``now``: its schedule's tick evaluated as the
    daemon evaluates it (each run's partitions and why), a file source's versions to retry."""
    asked = {}
    for spec in ALL_SOURCES:
        if isinstance(spec.partitions_def, TimeWindowPartitionsDefinition) and spec.schedule:
            schedule = location.resolve_schedule_def(f"{spec.name}_schedule")
            with build_schedule_context(instance=instance, scheduled_execution_time=now,
                                        repository_def=location.get_repository_def(),
                                        ) as context:
                tick = schedule.evaluate_tick(context)
            asked[spec.name] = [
                (request.partition_key, request.tags.get(RANGE_START_TAG),
                 request.tags.get(RANGE_END_TAG), request.tags[REQUESTED_BECAUSE_TAG])
                for request in tick.run_requests or []]
            assert asked[spec.name] == [
                (run.keys[0] if len(run.keys) == 1 else None,
                 None if len(run.keys) == 1 else run.keys[0],
                 None if len(run.keys) == 1 else run.keys[-1], run.requested_because())
                for run in plan_catch_up(instance, spec, now).runs]
        else:
            asked[spec.name] = [file_versions_to_retry(instance, spec, now)]
    return asked


def test_run_storage_lost_is_rebuilt_from_the_ledger(postgres, standin_server, tmp_path):
    inbox, archive = inbox_dirs(tmp_path)
    StandinClient(standin_server.url).reset_erp()
    with fresh_deployment(postgres, standin_server, tmp_path, "rebuild") as (home, env):
        env.update({"MOSTOVIK_LANDING_DIR": str(tmp_path / "landing"),
                    "MOSTOVIK_STORAGE_DIR": str(tmp_path / "storage"),
                    "MOSTOVIK_INBOX_DIR": str(inbox), "MOSTOVIK_ARCHIVE_DIR": str(archive),
                    "MOSTOVIK_CBR_METALS_URL": standin_server.endpoint_url("cbr_metal_prices")})
        create_instance_storage(home, env)
        location = code_location_for(env["MOSTOVIK_DATABASE_URL"], standin_server, tmp_path,
                                     ALL_SOURCES)
        with mock.patch.dict(os.environ, env), DagsterInstance.from_config(str(home)) as instance:
            loading_runs = {}
            for spec in ALL_SOURCES:
                if not isinstance(spec.partitions_def, TimeWindowPartitionsDefinition):
                    continue
                days = two_weeks(spec)
                result = location.resolve_job_def(f"{spec.name}_job").execute_in_process(
                    instance=instance, tags={RANGE_START_TAG: days[0], RANGE_END_TAG: days[-1]})
                assert result.success, spec.name
                loading_runs[spec.name] = result.run_id
            sensor = InboxSensor(location, instance, inbox_resource(tmp_path))
            for number in range(3):
                drop(inbox, f"site_{number}.csv", reports.csv_report(reports.report_table(
                    renumbered(reports.deliveries(4, seed=number), 1000 * number))))
            runs = sensor.run_new_versions()
            assert [r.success for r in runs.values()] == [True] * 3
            loading_runs["material_deliveries"] = {r.run_id for r in runs.values()}
            now = datetime.now(UTC)
            asked_before = catch_up(location, instance, now)

        services = DagsterServices(_dir(tmp_path / "ui-before"), home, env)
        services.start(daemon=False)
        try:
            with services.instance() as instance:
                shown_before = shown_materialised(services, instance)
        finally:
            services.stop()
        assert all(shown_before.values()), shown_before
        assert len(shown_before["cbr_daily_rates"]) == DAYS

        # Run storage is lost: its database dropped, and created again, empty.
        database = env["MOSTOVIK_DAGSTER_PG_DB"]
        with psycopg.connect(postgres.dsn(), autocommit=True) as connection:
            connection.execute(f"DROP DATABASE {database} WITH (FORCE)")
            connection.execute(f"CREATE DATABASE {database}")
        create_instance_storage(home, env)
        assert "cbr_daily_rates" not in mostovik(env, "jobs", "list", "--json")

        dry = mostovik(env, "tracker", "rebuild", "--dry-run")
        assert "cbr_daily_rates: 14 loaded partition(s) in the ledger, 0 already in run " \
               "storage, would record 14" in dry
        first = mostovik(env, "tracker", "rebuild")
        second = mostovik(env, "tracker", "rebuild")
        total = sum(len(keys) for keys in shown_before.values())
        assert f"recorded {total} partition(s)" in first
        assert "recorded 0 partition(s)" in second

        services = DagsterServices(_dir(tmp_path / "ui-after"), home, env)
        services.start(daemon=False)
        try:
            with services.instance() as instance:
                assert shown_materialised(services, instance) == shown_before
                asked_after = catch_up(location, instance, now)
        finally:
            services.stop()
        assert asked_after == asked_before
        # Nothing already loaded is asked for but the newest partition each tick refreshes.
        for spec in ALL_SOURCES:
            if isinstance(spec.partitions_def, TimeWindowPartitionsDefinition) and spec.schedule:
                with mock.patch.dict(os.environ, env), DagsterInstance.from_config(
                        str(home)) as instance:
                    runs = plan_catch_up(instance, spec, now).runs
                loaded = set(shown_before[spec.name])
                assert all(key not in loaded or why is Reason.NEWEST
                           for run in runs for key, why in run.reasons.items()), (spec.name, runs)

        listed = json.loads(mostovik(env, "jobs", "list", "--json"))
        assert {job["run_id"] for job in listed} == {
            *(run for name, run in loading_runs.items() if isinstance(run, str)),
            *loading_runs["material_deliveries"]}
        assert {job["status"] for job in listed} == {"completed"}
        rates = next(job for job in listed if job["source"] == "cbr_daily_rates")
        assert rates["partitions"] == shown_before["cbr_daily_rates"]


def _dir(path: Path) -> Path:
    path.mkdir()
    return path
