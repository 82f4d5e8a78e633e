"""The whole code location loads and defines what operators and CI rely on."""

from __future__ import annotations

from dagster import AssetKey, DailyPartitionsDefinition

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


def test_schedule_asks_for_today_and_tomorrow():
    from datetime import datetime
    from zoneinfo import ZoneInfo

    from dagster import build_schedule_context

    schedule = defs.get_repository_def().get_schedule_def("cbr_daily_rates_schedule")
    context = build_schedule_context(
        scheduled_execution_time=datetime(2026, 11, 10, 16, 0, tzinfo=ZoneInfo("Europe/Moscow")),
        repository_def=defs.get_repository_def(),
    )
    requests = list(schedule.evaluate_tick(context).run_requests)
    assert [r.partition_key for r in requests] == ["2026-11-10", "2026-11-11"]


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
