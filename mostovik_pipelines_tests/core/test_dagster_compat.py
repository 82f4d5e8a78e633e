"""Pins every private Dagster and dagster-celery name of ``dagster_compat``: that it is still
there and behaves as the project relies on. A Dagster upgrade that breaks one fails here."""

from __future__ import annotations

import inspect

import pytest
from dagster import (
    AssetCheckEvaluation,
    AssetKey,
    DagsterInstance,
    DagsterInvalidDefinitionError,
    MetadataValue,
    build_reconstructable_job,
    job,
    op,
)

from mostovik_pipelines.core import dagster_compat as compat


def test_a_check_evaluation_names_the_materialisation_it_checked():
    target = compat.AssetCheckEvaluationTargetMaterializationData(
        storage_id=7, run_id="run-1", timestamp=1.0)
    evaluation = AssetCheckEvaluation(asset_key=AssetKey("a"), check_name="c", passed=True,
                                      partition="2024-01-01", target_materialization_data=target)
    assert evaluation.target_materialization_data.storage_id == 7


def test_a_check_executions_status_tells_a_failed_verdict_from_a_planned_one():
    # operator/selection.py's --only differing reads the latest status of matches_source.
    assert {status.value for status in compat.AssetCheckExecutionRecordStatus} >= {
        "PLANNED", "SUCCEEDED", "FAILED"}


def test_a_job_of_the_code_location_is_reconstructed_by_module_and_attribute():
    job = compat.ReconstructableRepository.for_module(
        "mostovik_pipelines", "defs").get_reconstructable_job("cbr_daily_rates_job")
    assert job.get_definition().name == "cbr_daily_rates_job"


def _implicit_asset_job(_unused: str):
    from mostovik_pipelines.definitions import defs

    return defs.resolve_implicit_global_asset_job_def()


def test_the_public_reconstructable_job_refuses_the_job_of_asset_runs():
    """Why re-runs rebuild their job through the module's repository (the private
    ``ReconstructableRepository``) and not the public ``build_reconstructable_job``: that one
    puts the job in a repository of its own, which refuses Dagster's implicit asset job, the job
    of every ``dagster asset materialize`` and UI asset backfill run. When this fails, Dagster
    takes it: switch ``platform/recovery.py`` to the public API."""
    with pytest.raises(DagsterInvalidDefinitionError, match="reserved name"):
        build_reconstructable_job(__name__, _implicit_asset_job.__name__,
                                  ("implicit",)).get_definition()


def test_engine_event_data_carries_text_metadata():
    assert compat.EngineEventData({"host": "h"}).metadata == {"host": MetadataValue.text("h")}


def test_retry_modes_read_from_the_executor_config():
    assert compat.RetryMode.from_config({"enabled": {}}) is compat.RetryMode.ENABLED
    assert compat.RetryMode.from_config({"disabled": {}}) is compat.RetryMode.DISABLED


def test_the_op_output_store_builds_on_the_pickling_filesystem_io_manager(tmp_path):
    manager = compat.PickledObjectFilesystemIOManager(base_dir=str(tmp_path))
    assert callable(manager.handle_output) and callable(manager.load_input)


def test_the_run_key_tag_is_the_one_sensors_set():
    assert compat.RUN_KEY_TAG == "dagster/run_key"


def test_the_celery_executor_parts_keep_the_signatures_the_watched_executor_calls():
    config, executor, submit_task, execution_loop = compat.celery_executor_internals()
    assert set(config) == {"broker", "backend", "include", "config_source", "retries"}
    assert list(inspect.signature(executor.__init__).parameters) == [
        "self", "retries", "broker", "backend", "include", "config_source"]
    assert list(inspect.signature(submit_task).parameters) == [
        "app", "plan_context", "step", "queue", "priority", "known_state"]
    assert list(inspect.signature(execution_loop).parameters) == [
        "job_context", "execution_plan", "step_execution_fn"]


def test_a_local_instance_keeps_a_file_per_run_that_deleting_its_events_leaves(tmp_path):
    @op
    def step():
        return 1

    @job
    def one_step():
        step()

    with DagsterInstance.local_temp(str(tmp_path),
                                    overrides={"telemetry": {"enabled": False}}) as instance:
        run_id = one_step.execute_in_process(instance=instance).run_id
        shards = compat.run_event_log_dir(instance)
        assert (shards / f"{run_id}.db").is_file() and (shards / "index.db").is_file()
        instance.event_log_storage.delete_events(run_id)
        assert not instance.all_logs(run_id) and (shards / f"{run_id}.db").is_file()
    with DagsterInstance.ephemeral() as instance:
        assert compat.run_event_log_dir(instance) is None


def test_a_postgres_storage_engine_is_the_one_its_calls_use_and_the_webserver_swaps_it(postgres):
    import uuid

    import psycopg
    import sqlalchemy
    from dagster_postgres import PostgresRunStorage

    database = f"runs_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres.dsn(), autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {database}")
    storage = PostgresRunStorage(postgres.url(database, driver="psycopg2"))
    statements = []
    engine = compat.storage_engine(storage)
    sqlalchemy.event.listen(engine, "before_cursor_execute",
                            lambda *args: statements.append(args[2]))
    storage.get_runs()
    assert any("runs" in statement for statement in statements)

    storage.optimize_for_webserver(statement_timeout=0, pool_recycle=60, max_overflow=1)
    assert compat.storage_engine(storage) is not engine
    assert isinstance(compat.storage_engine(storage), sqlalchemy.engine.Engine)
