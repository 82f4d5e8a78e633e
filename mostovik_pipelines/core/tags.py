"""The run tags that make a Dagster run a business job of ADR-016: what operators filter the
UI's run list by (source, job kind, period, status), and nothing else."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from dagster import PartitionKeyRange, PartitionsDefinition, TimeWindowPartitionsDefinition

if TYPE_CHECKING:
    from dagster import DagsterInstance

TAG_PREFIX = "mostovik/"
SOURCE_TAG = f"{TAG_PREFIX}source"
JOB_TYPE_TAG = f"{TAG_PREFIX}job_type"
PARTITION_TAG = "dagster/partition"
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"

# A step's host, process, executor and Celery task are no tags: each step reports them in an
# engine event (see lifecycle.record_step), so the run list shows only what operators filter by.

# A run's ADR-016 status (``mostovik/status``) is written and read by .status alone.

# Written by the schedules and sensors that ask for partitions (framework/automation):
REQUESTED_BECAUSE_TAG = f"{TAG_PREFIX}requested_because"
"""Why the automation asked for the run's partitions: ``newest``, ``window_closed``,
``after_failure``, ``missing`` (several, comma-separated, for a ranged run)."""

# Metadata of a step's failure and of a ranged run's set-aside partitions:
ERROR_CLASS_KEY = f"{TAG_PREFIX}error_class"
"""``transient`` or ``permanent`` (:func:`mostovik_pipelines.core.errors.classify`)."""
PERMANENT = "permanent"
FAILED_PERMANENTLY_KEY = f"{TAG_PREFIX}failed_permanently"
"""The partitions of a ranged run set aside for a permanent reason: they wait for an operator."""

# Written by `mostovik jobs rerun`:
LAUNCHED_BY_TAG = f"{TAG_PREFIX}launched_by"
RERUN_OF_TAG = f"{TAG_PREFIX}rerun_of"

# Every run an operator asks for is signed (shown by `mostovik jobs list/show`, the UI's run
# list and the alerts about the run):
REQUESTED_BY_TAG = f"{TAG_PREFIX}requested_by"
"""Who asked for the run: the operator's OS user, or the name given with ``--as``."""
REASON_TAG = f"{TAG_PREFIX}reason"
"""Why the operator asked for it, in their words (``--reason``)."""


class TaggedSource(Protocol):
    """What the tags read of a source's declaration (a :class:`.SourceSpec`), named here so
    that the tags, which everything reads, import no declaration."""

    name: str
    job_type: Enum


def business_tags(spec: TaggedSource) -> dict[str, str]:
    """Tags every run of the source's job carries: its job type and its source."""
    return {JOB_TYPE_TAG: spec.job_type.value, SOURCE_TAG: spec.name}


def run_partitions(tags: Mapping[str, str], partitions_def: PartitionsDefinition,
                   dynamic_partitions_store: DagsterInstance | None = None) -> set[str]:
    """The partitions a run covers, by its partition tag or its range tags. A range of dynamic
    partitions (a single-run backfill of file versions) is read in the order the
    ``dynamic_partitions_store`` (the instance) keeps them; without it, its two ends."""
    if PARTITION_TAG in tags:
        return {tags[PARTITION_TAG]}
    start, end = tags.get(RANGE_START_TAG), tags.get(RANGE_END_TAG)
    if not (start and end):
        return set()
    if isinstance(partitions_def, TimeWindowPartitionsDefinition):
        return set(partitions_def.get_partition_keys_in_range(PartitionKeyRange(start, end)))
    keys = list(partitions_def.get_partition_keys(
        dynamic_partitions_store=dynamic_partitions_store)) if dynamic_partitions_store else []
    if start in keys and end in keys:
        return set(keys[keys.index(start):keys.index(end) + 1])
    return {start, end}
