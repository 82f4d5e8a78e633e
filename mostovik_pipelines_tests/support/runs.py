"""Running jobs and reading what run storage recorded about them."""

from __future__ import annotations

from dagster import DagsterEventType, DagsterInstance


def run_partition(job, partition: str, instance: DagsterInstance, run_id: str | None = None):
    return job.execute_in_process(partition_key=partition, instance=instance, raise_on_error=False,
                                  run_id=run_id)


def step_attempts(instance: DagsterInstance, run_id: str, op_name: str) -> int:
    """How many times a step started, as the event log tells it (first start plus restarts)."""
    records = instance.get_records_for_run(run_id).records
    return sum(
        1 for record in records
        if record.event_log_entry.dagster_event is not None
        and record.event_log_entry.dagster_event.step_key
        and record.event_log_entry.dagster_event.step_key.endswith(op_name)
        and record.event_log_entry.dagster_event.event_type
        in (DagsterEventType.STEP_START, DagsterEventType.STEP_RESTARTED)
    )


def step_failure_message(instance: DagsterInstance, run_id: str) -> str:
    """The description of the run's step failure, as an operator would read it."""
    for record in instance.get_records_for_run(
        run_id, of_type=DagsterEventType.STEP_FAILURE
    ).records:
        error = record.event_log_entry.dagster_event.step_failure_data.error
        user_failure = record.event_log_entry.dagster_event.step_failure_data.user_failure_data
        if user_failure is not None and user_failure.description:
            return user_failure.description
        return error.message if error else ""
    return ""


def load_metadata(instance: DagsterInstance, run_id: str) -> dict:
    records = instance.get_records_for_run(
        run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION
    ).records
    assert len(records) == 1, f"expected one materialisation, got {len(records)}"
    metadata = records[0].event_log_entry.asset_materialization.metadata
    return {key: value.value for key, value in metadata.items()}
