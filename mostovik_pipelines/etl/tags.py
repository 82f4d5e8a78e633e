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


def business_tags(spec: SourceSpec) -> dict[str, str]:
    """Tags every run of the source's job carries: its job type and its source."""
    return {JOB_TYPE_TAG: spec.job_type.value, SOURCE_TAG: spec.name}
