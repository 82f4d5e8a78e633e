"""Where each step hands its output to the next: Dagster's file-system I/O manager (pickles under
``MOSTOVIK_STORAGE_DIR``, shared by every worker: a directory, or ``s3://bucket/prefix`` reached
through universal_pathlib and s3fs, :mod:`.stores`), with its store's faults classified as the
landing store's are. An object store that does not answer (a restart, a network cut) is an
outage, ridden out in place for the object store's outage budget (:mod:`.core.outages`),
as the warehouse's is. A full disk (``ENOSPC``, a quota) fails the step as transient and it is
retried with backoff, since space can come back; a read-only one fails it at once, for an
operator to act. Either way the error names the file, and a pickle cut short is removed (an
upload cut short leaves no object): a re-execution from failure runs the step that failed
again, so nothing half-written is read.

The retention prune (:mod:`mostovik_pipelines.maintenance`) removes a finished run's outputs
once no recovery path can use them; a re-execution that asks for one after that fails at once,
naming the run and the setting (:class:`OpOutputPruned`), and loads nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from dagster import (
    FilesystemIOManager,
    InitResourceContext,
    InputContext,
    OutputContext,
    RetryRequested,
)

from mostovik_pipelines.core.dagster_compat import PickledObjectFilesystemIOManager
from mostovik_pipelines.core.errors import PermanentError, classify
from mostovik_pipelines.core.outages import Store, StoreAway, ride_out, wait_message
from mostovik_pipelines.core.retries import RetryPolicy, StepContext, failure_for
from mostovik_pipelines.core.settings import KEEP_FAILED_RUN_OUTPUTS_ENV
from mostovik_pipelines.core.tags import PARTITION_TAG, RANGE_END_TAG, RANGE_START_TAG
from mostovik_pipelines.resources.stores import store_options


class OpOutputPruned(PermanentError):
    """A re-execution asked for an output the retention prune has removed."""


class OpOutputStore(FilesystemIOManager):
    """``FilesystemIOManager`` whose disk faults are classified and retried (see the module)."""

    retry_attempts: int = 4
    retry_base_delay_seconds: float = 1.0

    def create_io_manager(self, context: InitResourceContext) -> PickledObjectFilesystemIOManager:
        base_dir = self.base_dir or context.instance.storage_directory()
        return _ClassifiedPickles(
            RetryPolicy(max_attempts=self.retry_attempts,
                        base_delay_seconds=self.retry_base_delay_seconds),
            base_dir=base_dir)


class _ClassifiedPickles(PickledObjectFilesystemIOManager):
    def __init__(self, policy: RetryPolicy, base_dir: str) -> None:
        # Another worker writes the same bucket: its listings are never cached (:mod:`.stores`).
        super().__init__(base_dir=base_dir, **store_options(base_dir))
        self.policy = policy
        self.base_dir = base_dir

    def load_from_path(self, context: InputContext, path) -> Any:
        try:
            return self._riding_out_outages(
                context, lambda: super(_ClassifiedPickles, self).load_from_path(context, path))
        except FileNotFoundError as missing:
            upstream = context.upstream_output
            run_id = upstream.run_id if upstream is not None else "?"
            step = upstream.step_key if upstream is not None else "?"
            raise OpOutputPruned(
                f"the output of {step} in run {run_id} is gone: the retention prune removes a "
                f"failed run's op outputs {KEEP_FAILED_RUN_OUTPUTS_ENV} days after it ended "
                "(a successful run's after a day), so this run can no longer be re-executed "
                "from its failure; run its partitions again instead (mostovik jobs rerun "
                "--source S --period P, or the UI's re-execute all steps)") from missing

    def handle_output(self, context: OutputContext, obj: Any) -> None:
        # The fence: a run that lost its claim hands nothing on (RunClaimLost fails the step).
        # Imported here: the claims bring psycopg, which loading the code location must not.
        from mostovik_pipelines.platform.claims import ensure_run_claim

        ensure_run_claim(context.run_id)
        try:
            self._riding_out_outages(
                context, lambda: super(_ClassifiedPickles, self).handle_output(context, obj))
        except OSError as error:
            raise self._retry_or_fail(context, error) from error

    def _riding_out_outages(self, context: InputContext | OutputContext, call: Callable[[], Any],
                            ) -> Any:
        """``call()``, ridden out while the object store does not answer, for up to its outage
        budget (:func:`.outages.ride_out`); past it, the step fails as transient naming the
        setting. A write that did not complete left no object (an upload is whole or absent),
        so trying again is safe."""
        def say(store: Store, error: BaseException, seconds: float, wait: float) -> None:
            context.log.warning(
                f"{_step(context).describe()}: {wait_message(store, error, seconds, wait)}")

        try:
            return ride_out(Store.OBJECT_STORE, call, answers=True, on_wait=say)
        except StoreAway as gone:
            raise failure_for(_step(context), classify(gone), 1, self.policy) from gone

    def dump_to_path(self, context: OutputContext, obj: Any, path) -> None:
        try:
            super().dump_to_path(context, obj, path)
        except OSError as error:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            # Named here: the file system layer under the I/O manager drops the file name.
            raise OSError(error.errno, error.strerror, str(path)) from error

    def _retry_or_fail(self, context: OutputContext, error: OSError) -> Exception:
        """A retry of the step while the fault is transient and attempts are left, else its
        final failure naming the file."""
        verdict = classify(error)
        attempt = context.step_context.previous_attempt_count + 1
        step = _step(context)
        if verdict.transient and attempt < self.policy.max_attempts:
            wait = self.policy.wait_seconds(attempt)
            context.log.warning(f"{step.describe()}: attempt {attempt} of "
                                f"{self.policy.max_attempts} failed ({verdict.kind}: "
                                f"{verdict.reason}); retrying in {wait:.1f}s")
            return RetryRequested(max_retries=self.policy.max_attempts - 1, seconds_to_wait=wait)
        return failure_for(step, verdict, attempt, self.policy)


def _step(context: InputContext | OutputContext) -> StepContext:
    step_context = context.step_context
    step_key = step_context.step.key
    what = (f"output {context.name!r}" if isinstance(context, OutputContext)
            else f"input {context.name!r}")
    return StepContext(source=step_key.split(".", 1)[0],
                       partition_key=_partitions(step_context.run_tags),
                       step=f"{step_key}, {what}")


def _partitions(tags: dict[str, str]) -> str:
    if PARTITION_TAG in tags:
        return tags[PARTITION_TAG]
    if RANGE_START_TAG in tags:
        return f"{tags[RANGE_START_TAG]}..{tags.get(RANGE_END_TAG, '')}"
    return "unpartitioned"
