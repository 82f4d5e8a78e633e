"""The whole code location loads and defines what operators and CI rely on."""

from __future__ import annotations

from dagster import AssetCheckKey, AssetKey, DailyPartitionsDefinition

import mostovik_pipelines
from mostovik_pipelines.definitions import defs


def test_the_package_exposes_the_code_location_for_dagster_job_execute():
    assert mostovik_pipelines.defs is defs


def test_every_source_is_a_partitioned_asset_of_three_ops_with_a_job_and_a_schedule():
    repository = defs.get_repository_def()
    asset = defs.resolve_assets_def(AssetKey("cbr_daily_rates"))
    assert isinstance(asset.partitions_def, DailyPartitionsDefinition)
    assert asset.partitions_def.timezone == "Europe/Moscow"
    assert [node.name for node in asset.node_def.node_defs] == [
        "extract_cbr_daily_rates", "transform_cbr_daily_rates", "load_cbr_daily_rates",
    ]
    job = defs.resolve_job_def("cbr_daily_rates_job")
    assert job.partitions_def == asset.partitions_def
    assert job.tags["mostovik/source"] == "cbr_daily_rates"
    assert job.tags["mostovik/job_type"] == "parser"
    assert int(job.tags["dagster/max_runtime"]) > 0
    assert job.executor_def.name == "in_process"
    schedule = repository.get_schedule_def("cbr_daily_rates_schedule")
    assert schedule.execution_timezone == "Europe/Moscow"
    assert set(repository.get_top_level_resources()) >= {
        "warehouse", "landing", "io_manager", "cbr_daily_rates_source",
    }


def test_the_newest_cbr_partition_is_tomorrow_in_moscow():
    from datetime import datetime, timedelta
    from zoneinfo import ZoneInfo

    keys = defs.resolve_assets_def(AssetKey("cbr_daily_rates")).partitions_def.get_partition_keys()
    tomorrow = datetime.now(ZoneInfo("Europe/Moscow")).date() + timedelta(days=1)
    assert keys[0] == "2020-01-01"
    assert keys[-1] == tomorrow.isoformat()


def test_the_schedule_asks_for_tomorrow_and_every_day_of_its_lookback_not_loaded_in_one_run():
    """On an instance with nothing loaded, the 16:00 tick asks for tomorrow's rates (newest)
    and the week before it (missing), as one ranged run: the CBR's backfill policy is a single
    run. What it asks for once partitions are loaded is test_catch_up.py's."""
    from datetime import datetime
    from zoneinfo import ZoneInfo

    from dagster import build_schedule_context, instance_for_test

    from mostovik_pipelines.core.tags import (
        RANGE_END_TAG,
        RANGE_START_TAG,
        REQUESTED_BECAUSE_TAG,
    )

    schedule = defs.get_repository_def().get_schedule_def("cbr_daily_rates_schedule")
    with instance_for_test() as instance, build_schedule_context(
        instance=instance,
        scheduled_execution_time=datetime(2026, 11, 10, 16, 0, tzinfo=ZoneInfo("Europe/Moscow")),
        repository_def=defs.get_repository_def(),
    ) as context:
        (request,) = schedule.evaluate_tick(context).run_requests
    assert (request.tags[RANGE_START_TAG], request.tags[RANGE_END_TAG]) == (
        "2026-11-03", "2026-11-11")
    assert request.tags[REQUESTED_BECAUSE_TAG] == (
        "missing 2026-11-03..2026-11-10; newest 2026-11-11")


def test_the_workspace_file_loads_the_code_location_as_dagster_dev_does():
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    completed = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "definitions", "validate",
         "-w", "workspace.yaml"],
        cwd=repo, capture_output=True, text=True, timeout=180,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    output = completed.stdout + completed.stderr
    assert "Validation successful for code location mostovik_pipelines" in output


def test_every_source_asset_reads_well_in_the_asset_graph():
    from mostovik_pipelines.framework.quality.checks import partition_checks
    from mostovik_pipelines.framework.verification.check import MATCHES_SOURCE
    from mostovik_pipelines.sources import ALL_SOURCES

    for spec in ALL_SOURCES:
        asset = defs.resolve_assets_def(AssetKey(spec.name))
        asset_spec = asset.specs_by_key[AssetKey(spec.name)]
        assert asset_spec.description == spec.description and spec.description
        assert asset_spec.owners == ["team:back-office-data"]
        assert asset_spec.kinds == {"postgres", spec.protocol}
        assert asset_spec.group_name == spec.job_type.value
        schema = asset_spec.metadata["dagster/column_schema"]
        assert [c.name for c in schema.columns] == list(spec.table.columns.keys())
        assert {key.name for key in asset.check_keys} == {
            *(check.name for check in partition_checks(spec)), MATCHES_SOURCE}
        assert all(check_spec.partitions_def == spec.partitions_def
                   for check_spec in asset.check_specs)
        # No Dagster freshness policy: it reads the newest load of any partition, so an old
        # day re-loaded would make a source fresh while a due one is missing. The deadline
        # check says which periods are late.
        assert asset_spec.freshness_policy is None
        deadline = AssetCheckKey(AssetKey(spec.name), "period_deadlines")
        time_partitioned = spec.name != "material_deliveries"
        assert (spec.deadline is not None) is time_partitioned
        assert (deadline in defs.get_repository_def().asset_graph.asset_check_keys) is (
            time_partitioned)
        job = defs.resolve_job_def(f"{spec.name}_job")
        assert deadline not in job.asset_layer.asset_graph.asset_check_keys


def test_the_alert_sensors_run_by_default_and_watch_every_job_of_the_location():
    from dagster import DefaultSensorStatus

    repository = defs.get_repository_def()
    failures = repository.get_sensor_def("run_failure_alerts")
    others = [repository.get_sensor_def(name) for name in (
        "source_shape_alerts", "alert_outbox", "period_deadlines", "cancelled_runs_status")]
    assert failures.default_status is DefaultSensorStatus.RUNNING
    assert all(sensor.default_status is DefaultSensorStatus.RUNNING for sensor in others)
    # No monitored jobs and not all code locations: every job of this location, the implicit
    # asset job of UI asset backfills included.
    assert failures._monitored_jobs == [] and not failures._monitor_all_code_locations
    assert {"alert_notifier"} <= set(failures.required_resource_keys)


def test_dg_checks_lists_and_launches_next_to_the_classic_cli(
    sqlite_warehouse_url, standin_server, standin, tmp_path
):
    """`dg check defs`, `dg list defs` and `dg launch --job --partition` against this project
    (run together: each loads the code location)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from dagster import DagsterInstance, DagsterRunStatus

    from mostovik_pipelines.sources import ALL_SOURCES
    from mostovik_pipelines_tests.support.processes import REPO, run_environment
    from mostovik_pipelines_tests.support.warehouse import table_rows

    bin_dir = Path(sys.executable).parent
    environment = {**run_environment(tmp_path, sqlite_warehouse_url, standin_server.cbr_url),
                   "VIRTUAL_ENV": str(bin_dir.parent), "NO_COLOR": "1"}

    def dg(*args: str) -> subprocess.Popen:
        return subprocess.Popen([str(bin_dir / "dg"), *args], cwd=REPO, env=environment,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    running = {"check": dg("check", "defs"), "list": dg("list", "defs", "--json"),
               "launch": dg("launch", "--job", "cbr_daily_rates_job",
                            "--partition", "2026-11-02")}
    done = {name: (process, *process.communicate(timeout=240))
            for name, process in running.items()}
    for name, (process, _, stderr) in done.items():
        assert process.returncode == 0, f"dg {name}: {stderr[-3000:]}"
    assert "All definitions loaded successfully" in done["check"][1] + done["check"][2]
    listed = json.loads(done["list"][1])
    assert {a["asset_key"] for a in listed["assets"]} == {s.name for s in ALL_SOURCES}
    assert {"cbr_daily_rates_job", "erp_work_orders_job"} <= {j["name"] for j in listed["jobs"]}
    assert {"run_failure_alerts", "period_deadlines", "alert_outbox"} <= {
        s["name"] for s in listed["sensors"]}
    with DagsterInstance.from_config(environment["DAGSTER_HOME"]) as instance:
        [run] = instance.get_runs()
    assert run.status is DagsterRunStatus.SUCCESS
    assert run.tags["dagster/partition"] == "2026-11-02"
    assert run.tags["mostovik/status"] == "completed"
    assert len(table_rows(sqlite_warehouse_url, "cbr_daily_rates")) == 12


STEP_LIBRARIES = ("pandas", "numpy", "pyarrow", "pgpq", "psycopg", "httpx", "python_calamine")
"""What the steps use to fetch, read and load, and loading the code location must not import:
every code server, daemon and webserver process loads it, most never run a step."""


def test_loading_the_code_location_imports_none_of_the_steps_libraries():
    import subprocess
    import sys

    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, mostovik_pipelines.definitions; "
         f"print(' '.join(m for m in {STEP_LIBRARIES!r} if m in sys.modules))"],
        capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []
