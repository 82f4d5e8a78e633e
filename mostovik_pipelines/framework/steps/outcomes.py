"""What one step hands to the next, per partition (pickled in the op-output store)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from mostovik_pipelines.framework.quality.shape import ShapeReport
from mostovik_pipelines.framework.spec import PageCursor, RejectedRow
from mostovik_pipelines.resources.landing import LandedPayload

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class TransformedPartition:
    """What transform hands to load for one partition: rows to load, rows to quarantine. The
    rows are kept pickled (:meth:`of`): a ranged run hands the load every partition at once, and
    a validated frame of a CBR day takes about 24 KB of memory, its pickle 3 KB (five years of
    frames held 44 MB, twice: in transform's output and in load's input)."""

    packed_frame: bytes
    landed: LandedPayload
    duplicates_dropped: int
    rejected: tuple[RejectedRow, ...]
    row_numbers: tuple[int, ...] | None = None
    """Each row's position in the payload (what a quarantined row is numbered by)."""
    shape: ShapeReport | None = None
    """The payload's fields against the declaration's (:mod:`.quality.shape`)."""

    @classmethod
    def of(cls, frame: pd.DataFrame, *args, **kwargs) -> TransformedPartition:
        return cls(pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL), *args, **kwargs)

    @property
    def frame(self) -> pd.DataFrame:
        """The validated rows (unpickled at each call: take it once)."""
        return pickle.loads(self.packed_frame)


@dataclass(frozen=True)
class PayloadUnchanged:
    """What transform hands to load for a partition whose landed payload is the one its stored
    rows came from, parsed by the same code, with rows the ledger's digest still vouches for
    (:mod:`.unchanged`): its rows are not validated, hashed or compared again. The load confirms
    it under its locks; should the ledger say otherwise by then, it makes the payload's rows and
    loads them as any other."""

    landed: LandedPayload
    content_digest: str
    """The digest of the stored rows the ledger named when transform looked."""
    parser_version: str
    parsed_rows: int
    """Rows the parser read (before validation)."""
    parser_rejected: int
    """Rows the parser itself rejected."""
    preview: str
    """The first rows the parser read, as the materialisation's preview (Markdown)."""
    shape: ShapeReport | None = None


@dataclass(frozen=True)
class PartitionSkipped:
    """A partition with nothing to load (not published yet, stopped for a concurrent run,
    superseded by a newer load)."""

    partition_key: str
    reason: str


@dataclass(frozen=True)
class PartitionFailure:
    """A partition of a ranged run that failed for good; the other partitions go on."""

    partition_key: str
    step: str
    message: str
    permanent: bool = False
    """The failure is permanent (a contract or validation error): the partition waits for an
    operator and is never asked for again automatically (:mod:`.automation`)."""


@dataclass(frozen=True)
class PartitionLoaded:
    """A partition a re-execution finds already loaded by the run it repeats: nothing to do."""

    partition_key: str
    run_id: str


@dataclass(frozen=True)
class LandedPages:
    """A paged partition's pages landed by this run, from where its committed progress left
    off (``resumed_after_page`` pages were committed before; 0: from the start)."""

    pages: tuple[LandedPayload, ...]
    resumed_after_page: int


@dataclass(frozen=True)
class TransformedPageGroup:
    """Consecutive pages validated together, to be committed in one transaction with the
    checkpoint at ``last_page`` (:attr:`.SourceSpec.rows_per_commit`)."""

    first_page: int
    last_page: int
    frame_path: str
    """The group's validated rows, kept next to the landed pages (memory holds one group)."""
    rows: int
    rejected: tuple[RejectedRow, ...]
    duplicates_dropped: int
    next_cursor: dict | None
    """Where the page after the group starts; None: the group ends the partition."""


@dataclass(frozen=True)
class TransformedPages:
    groups: tuple[TransformedPageGroup, ...]
    resumed_after_page: int
    pages: int
    payload_bytes: int
    content_hash: str
    """The digest of the partition's pages' hashes, in page order."""
    fetched_at: datetime | None
    """When the first page was fetched."""
    shape: ShapeReport | None = None
    """The pages' fields against the declaration's (:mod:`.quality.shape`)."""


PartitionLeftOut = PartitionSkipped | PartitionFailure | PartitionLoaded
"""A partition a step has nothing more to do for: skipped, failed, or loaded by the run a
re-execution repeats; every later step passes it on as it is."""

Extracted = LandedPayload | LandedPages | PartitionLeftOut
"""What extract hands transform for a partition: its landed payload, or its landed pages."""

Transformed = TransformedPartition | TransformedPages | PayloadUnchanged | PartitionLeftOut
"""What transform hands load for a partition: its rows validated whole, or in page groups, or
that its payload is the one its stored rows came from."""


@dataclass(frozen=True)
class StepOutcomes:
    """What a step hands to the next, per partition, and the run that produced it: a step of
    another run (a re-execution's inherited input) is history, never acted upon."""

    run_id: str
    partitions: dict[str, Extracted | Transformed] = field(default_factory=dict)

    def to_load(self) -> dict[str, TransformedPartition | TransformedPages | PayloadUnchanged]:
        """The partitions transform validated rows for, or found unchanged."""
        return {key: outcome for key, outcome in self.partitions.items()
                if isinstance(outcome, TransformedPartition | TransformedPages | PayloadUnchanged)}

    def skipped(self) -> list[PartitionSkipped]:
        return [o for o in self.partitions.values() if isinstance(o, PartitionSkipped)]

    def failed(self) -> list[PartitionFailure]:
        return [o for o in self.partitions.values() if isinstance(o, PartitionFailure)]


def page_cursor(record: dict | None) -> PageCursor | None:
    """The cursor a landed page records (as a dict), or None."""
    return PageCursor(**record) if record else None
