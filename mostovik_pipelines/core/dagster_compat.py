"""Every private Dagster and dagster-celery name the project uses, in one place.

Dagster 1.13 has no public API for these; each is pinned by
``framework/test_dagster_compat*.py`` (its existence and the behaviour we rely on), so an upgrade
that moves or changes one fails there, named, not somewhere in a run. The tests' own daemon
wrapper is the one other private use (``mostovik_pipelines_tests/support/dagster_daemon.py``,
pinned by ``test_dagster_daemon.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dagster import DagsterEventType
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)
from dagster._core.definitions.reconstruct import ReconstructableRepository
from dagster._core.events import EngineEventData, JobFailureData, RunFailureReason
from dagster._core.execution.api import create_execution_plan
from dagster._core.execution.backfill import BulkActionsFilter, BulkActionStatus, PartitionBackfill
from dagster._core.execution.plan.state import KnownExecutionState
from dagster._core.execution.retries import RetryMode, auto_reexecution_should_retry_run
from dagster._core.remote_origin import (
    ManagedGrpcPythonEnvCodeLocationOrigin,
    RemoteJobOrigin,
    RemoteRepositoryOrigin,
)
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus
from dagster._core.storage.fs_io_manager import PickledObjectFilesystemIOManager
from dagster._core.storage.tags import (
    AUTO_RETRY_RUN_ID_TAG,
    BACKFILL_TAGS,
    PARENT_RUN_ID_TAG,
    RESUME_RETRY_TAG,
    RETRY_NUMBER_TAG,
    ROOT_RUN_ID_TAG,
    RUN_FAILURE_REASON_TAG,
    RUN_KEY_TAG,
    TAGS_TO_MAYBE_OMIT_ON_RETRY,
    WILL_RETRY_TAG,
)
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

__all__ = [
    "AUTO_RETRY_RUN_ID_TAG",
    "BACKFILL_TAGS",
    "PARENT_RUN_ID_TAG",
    "RESUME_RETRY_TAG",
    "RETRY_NUMBER_TAG",
    "ROOT_RUN_ID_TAG",
    "RUN_KEY_TAG",
    "TAGS_TO_MAYBE_OMIT_ON_RETRY",
    "WILL_RETRY_TAG",
    "AssetCheckEvaluationTargetMaterializationData",
    "AssetCheckExecutionRecordStatus",
    "BulkActionStatus",
    "BulkActionsFilter",
    "EngineEventData",
    "KnownExecutionState",
    "LoadableTargetOrigin",
    "ManagedGrpcPythonEnvCodeLocationOrigin",
    "PartitionBackfill",
    "PickledObjectFilesystemIOManager",
    "ReconstructableRepository",
    "RemoteJobOrigin",
    "RemoteRepositoryOrigin",
    "RetryMode",
    "celery_executor_internals",
    "code_server_runs",
    "create_execution_plan",
    "daemon_would_retry",
    "retry_made_of",
    "retry_pass_cursor",
    "run_event_log_dir",
    "run_failed_unexpectedly",
]


def celery_executor_internals() -> tuple[Any, Any, Any, Any]:
    """dagster-celery's executor config schema, executor class, step submission and execution
    loop (imported here, when the Celery executor is built: they import Celery)."""
    from dagster_celery.core_execution_loop import core_celery_execution_loop
    from dagster_celery.executor import CELERY_CONFIG, CeleryExecutor
    from dagster_celery.executor import _submit_task as submit_task

    return CELERY_CONFIG, CeleryExecutor, submit_task, core_celery_execution_loop


def run_failed_unexpectedly(instance: Any, run: Any, message: str) -> None:
    """Mark ``run`` failed from outside it as an infrastructure failure: the run failure event
    carries the reason ``UNEXPECTED_TERMINATION`` (what Dagster records for a run worker
    interrupted unexpectedly), so run storage tags the run ``dagster/failure_reason`` with it and
    the daemon's run retries, which never retry a ``STEP_FAILURE`` under
    ``retry_on_asset_or_op_failure: false``, run it again. ``report_run_failed`` is public; the
    failure data and reason it takes are not."""
    instance.report_run_failed(run, message, JobFailureData(
        error=None, failure_reason=RunFailureReason.UNEXPECTED_TERMINATION))


def daemon_would_retry(instance: Any, run: Any) -> bool:
    """Whether the daemon's run retries retry the failed ``run`` by Dagster's own rule, not by the
    ``dagster/will_retry`` tag: the rule that tag was set by (run retries enabled, its failure
    reason, the max retries, the retries its run group already has), and a backfill's run only
    while the backfill goes on. The tag alone cannot say: the retry pass sets it false when
    making the retry raised."""
    from dagster._core.execution.backfill import BULK_ACTION_TERMINAL_STATUSES
    from dagster._core.storage.tags import BACKFILL_ID_TAG

    if not instance.run_retries_enabled:
        return False
    reason = run.tags.get(RUN_FAILURE_REASON_TAG)
    if not auto_reexecution_should_retry_run(instance, run,
                                             RunFailureReason(reason) if reason else None):
        return False
    backfill_id = run.tags.get(BACKFILL_ID_TAG)
    if backfill_id is None:
        return True
    backfill = instance.get_backfill(backfill_id)
    return backfill is not None and backfill.status not in BULK_ACTION_TERMINAL_STATUSES


def retry_made_of(instance: Any, run: Any) -> Any:
    """The retry already made of ``run``, by the daemon's run retries' own test (the run its
    ``dagster/auto_retry_run_id`` names, else a child of it numbered as a retry), or None."""
    from dagster._daemon.auto_run_reexecution.auto_run_reexecution import (
        get_automatically_retried_run_if_exists,
    )

    group = instance.get_run_group(run.run_id)
    return get_automatically_retried_run_if_exists(instance, run, list(group[1]) if group else [])


def retry_pass_cursor(instance: Any) -> int | None:
    """The storage id of the newest run failure event the daemon's run retries have taken up;
    None before their first pass. Their event log consumer stores it once the pass over the
    batch is done: every failure event up to it was either retried, given up, or skipped (read
    before its run's status was failed), and is never looked at again."""
    from dagster._daemon.auto_run_reexecution.event_log_consumer import _create_cursor_key

    key = _create_cursor_key(DagsterEventType.RUN_FAILURE)
    value = instance.daemon_cursor_storage.get_cursor_values({key}).get(key)
    return int(value) if value is not None else None


CODE_SERVER_TIMEOUT_SECONDS = 10


def code_server_runs(run: Any) -> bool | None:
    """Whether the code server that launched ``run`` still executes it: what that server answers
    when asked whether the run can be cancelled (it can while the server holds the run's live
    process and no cancel was asked for); False when it cannot be reached or is another
    server now (started again, it knows none of the old one's runs); None for a run no code
    server launched. The server named is the run's ``dagster/grpc_info`` tag, which Dagster's
    run launcher writes just before it asks the server to start the run."""
    import json

    from dagster._core.errors import DagsterUserCodeUnreachableError
    from dagster._core.storage.tags import GRPC_INFO_TAG
    from dagster._grpc.client import DagsterGrpcClient
    from dagster._grpc.types import CanCancelExecutionRequest, CanCancelExecutionResult
    from dagster._serdes import deserialize_value

    if GRPC_INFO_TAG not in run.tags:
        return None
    info = json.loads(run.tags[GRPC_INFO_TAG])
    client = DagsterGrpcClient(port=info.get("port"), socket=info.get("socket"),
                               host=info.get("host", "localhost"),
                               use_ssl=bool(info.get("use_ssl", False)))
    try:
        answer = client.can_cancel_execution(CanCancelExecutionRequest(run_id=run.run_id),
                                             timeout=CODE_SERVER_TIMEOUT_SECONDS)
    except DagsterUserCodeUnreachableError:
        return False
    return deserialize_value(answer, CanCancelExecutionResult).can_cancel


def run_event_log_dir(instance: Any) -> Path | None:
    """Where the event log keeps one SQLite database per run (the local instance:
    ``<storage>/history/runs/<run_id>.db``, with ``-wal``/``-shm`` beside it while open, and the
    ``index.db`` of every run), files that Dagster's ``delete_events`` empties but never
    removes; ``None`` for an event log with no files per run (PostgreSQL, a consolidated
    SQLite)."""
    from dagster._core.storage.event_log.sqlite.sqlite_event_log import SqliteEventLogStorage

    storage = instance.event_log_storage
    if not isinstance(storage, SqliteEventLogStorage):
        return None
    return Path(storage.path_for_shard("index")).parent


def storage_engine(storage: Any) -> Any:
    """The SQLAlchemy engine of a dagster-postgres run, event-log or schedule storage: its
    private ``_engine``, the one its calls use, which ``optimize_for_webserver`` replaces (the
    outage guard listens on every engine the storage is given)."""
    return storage._engine
