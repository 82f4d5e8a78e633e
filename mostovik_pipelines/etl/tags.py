"""The run tags that make a Dagster run a business job of ADR-016."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mostovik_pipelines.etl.spec import SourceSpec

TAG_PREFIX = "mostovik/"
SOURCE_TAG = f"{TAG_PREFIX}source"
JOB_TYPE_TAG = f"{TAG_PREFIX}job_type"
PARTITION_TAG = "dagster/partition"
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"

# Written by the run itself as its steps start (see tracking.record_step):
HOST_TAG = f"{TAG_PREFIX}host"
PID_TAG = f"{TAG_PREFIX}pid"
"""The host and process of the run's current step: tells a live run from a killed one."""
EXECUTOR_TAG = f"{TAG_PREFIX}executor"
CELERY_TASK_TAG_PREFIX = f"{TAG_PREFIX}celery_task."
"""Followed by the op name: the Celery task that executed that step."""

# Written by the run itself as it ends (see tracking.job_status_of), or for a run that died
# without a word, by the job status sensor once run storage marks it failed:
STATUS_TAG = f"{TAG_PREFIX}status"
"""The ADR-016 status of a finished job: completed, partial or failed."""

# Written by `mostovik jobs rerun`:
LAUNCHED_BY_TAG = f"{TAG_PREFIX}launched_by"
RERUN_OF_TAG = f"{TAG_PREFIX}rerun_of"


def business_tags(spec: SourceSpec) -> dict[str, str]:
    """Tags every run of the source's job carries: its job type and its source."""
    return {JOB_TYPE_TAG: spec.job_type.value, SOURCE_TAG: spec.name}
