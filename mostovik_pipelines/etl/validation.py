"""Checks every transformed partition passes before it may be loaded.

A source's transform checks its own format; these checks hold for every source: the frame has
the target's columns, every row belongs to the partition being loaded, natural keys are
complete, and a natural key appears once. Exact duplicate rows are dropped (the source repeated
itself); two different rows with one natural key are a defect of the source and fail the run.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from mostovik_pipelines.etl.errors import DataValidationError
from mostovik_pipelines.etl.loading import LoadTarget

SHOWN_EXAMPLES = 5


@dataclass(frozen=True)
class ValidatedFrame:
    frame: pd.DataFrame
    duplicates_dropped: int


def validate_partition_frame(
    frame: pd.DataFrame, target: LoadTarget, partition_key: str
) -> ValidatedFrame:
    """The frame ready to load, or :class:`DataValidationError` saying what is wrong."""
    expected = target.columns
    missing = [c for c in expected if c not in frame.columns]
    unexpected = [c for c in frame.columns if c not in expected]
    if missing or unexpected:
        raise DataValidationError(
            f"columns do not match table {target.table.name}: missing {missing}, "
            f"unexpected {unexpected}"
        )
    frame = frame[expected]

    incomplete = frame[list(target.natural_key)].isna().any(axis=1)
    if incomplete.any():
        raise DataValidationError(
            f"{int(incomplete.sum())} rows have an empty natural key {list(target.natural_key)}, "
            f"first at row {int(incomplete.to_numpy().nonzero()[0][0])}"
        )

    if target.mode.value == "replace_partition":
        expected_value = target.partition_value(partition_key)
        outside = frame[target.partition_column] != expected_value
        if outside.any():
            examples = frame.loc[outside, target.partition_column].head(SHOWN_EXAMPLES).tolist()
            raise DataValidationError(
                f"{int(outside.sum())} rows do not belong to partition {partition_key} "
                f"({target.partition_column} = {examples})"
            )

    exact_duplicates = frame.duplicated(keep="first")
    deduplicated = frame[~exact_duplicates]
    conflicting = deduplicated.duplicated(subset=list(target.natural_key), keep=False)
    if conflicting.any():
        examples = (
            deduplicated.loc[conflicting, list(target.natural_key)]
            .drop_duplicates().head(SHOWN_EXAMPLES).to_dict("records")
        )
        raise DataValidationError(
            f"{int(conflicting.sum())} rows share a natural key with different data: {examples}"
        )
    return ValidatedFrame(deduplicated.reset_index(drop=True), int(exact_duplicates.sum()))
