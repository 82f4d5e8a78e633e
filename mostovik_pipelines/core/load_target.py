"""What a source's declaration says about where its rows go and how (the loader's contract)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date
from typing import Any

from sqlalchemy import Date, Table

from mostovik_pipelines.warehouse.schema import data_columns


class LoadMode(enum.StrEnum):
    """How a partition's rows reach the target table."""

    REPLACE_PARTITION = "replace_partition"
    """The source gives the whole truth for the partition: rows it no longer has are deleted."""

    MERGE_BY_VERSION = "merge_by_version"
    """Incremental: newer versions win, older ones never overwrite; nothing deleted by absence."""


class KeyHeldElsewhere(enum.StrEnum):
    """What happens to an incoming row whose natural key is stored under another partition value
    (only possible when the partition column is not part of the natural key)."""

    MOVE = "move"
    """The row moves to this partition (a synced record updated into a later window)."""

    REJECT = "reject"
    """The row is rejected to quarantine and the stored row stays where it is (two delivery
    files claiming the same waybill line: never a silent overwrite)."""


@dataclass(frozen=True)
class LoadTarget:
    """Where and how a source's rows are written."""

    table: Table
    natural_key: Sequence[str]
    partition_column: str
    mode: LoadMode
    version_column: str | None = None
    tombstone_column: str | None = None
    partition_value_of: Callable[[str], Any] | None = None
    key_held_elsewhere: KeyHeldElsewhere = KeyHeldElsewhere.MOVE
    empty_payload_is_valid: bool = False
    """A payload of no rows is a legitimate delivery (replace mode: it empties the partition)."""

    @property
    def columns(self) -> list[str]:
        return data_columns(self.table)

    def partition_value(self, partition_key: str) -> Any:
        """The partition key as the partition column stores it."""
        if self.partition_value_of is not None:
            return self.partition_value_of(partition_key)
        if isinstance(self.table.c[self.partition_column].type, Date):
            return date.fromisoformat(partition_key)
        return partition_key

    def partition_scope(self, partition_key: str) -> str:
        """What the business lock and the ledger are keyed by: the partition column's value, so
        that two keys of one value (two versions of one file) take turns and share a history."""
        return str(self.partition_value(partition_key))
