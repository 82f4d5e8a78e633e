"""The load op's work: upsert each partition in a transaction of its own (a paged partition in
groups of pages, each with its progress checkpoint), then record its materialisation and the
result of every check of it."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import pandas as pd
from dagster import (
    AssetKey,
    AssetMaterialization,
    AssetObservation,
    Failure,
    MetadataValue,
    OpExecutionContext,
)

from mostovik_pipelines.core.errors import PartitionCheckFailed, classify
from mostovik_pipelines.core.load_target import LoadMode
from mostovik_pipelines.core.retries import NO_RETRY, StepContext
from mostovik_pipelines.core.tags import FAILED_PERMANENTLY_KEY
from mostovik_pipelines.framework.assets.resource_keys import (
    LANDING_KEY,
    WAREHOUSE_KEY,
    source_resource_key,
)
from mostovik_pipelines.framework.assets.view import PREVIEW_ROWS, preview
from mostovik_pipelines.framework.load.ledger import record_load
from mostovik_pipelines.framework.load.partition import (
    KeptRows,
    LoadCounts,
    PartitionSuperseded,
    confirm_unchanged,
    load_partition,
)
from mostovik_pipelines.framework.quality.checks import blocks, evaluate_partition
from mostovik_pipelines.framework.quality.quarantine import quarantined_count, replace_quarantine
from mostovik_pipelines.framework.quality.shape import shape_metadata
from mostovik_pipelines.framework.quality.validation import row_text
from mostovik_pipelines.framework.spec import LoadedPartition, ReceivedRows, RejectedRow, SourceSpec
from mostovik_pipelines.framework.steps.lifecycle import fail_or_set_aside, riding_out
from mostovik_pipelines.framework.steps.outcomes import (
    PartitionFailure,
    PartitionSkipped,
    PayloadUnchanged,
    StepOutcomes,
    TransformedPages,
    TransformedPartition,
    page_cursor,
)
from mostovik_pipelines.framework.steps.reexecution import partitions_materialized_by_run
from mostovik_pipelines.framework.steps.sync_progress import committed_progress, save_progress
from mostovik_pipelines.framework.steps.transform import transform_partition
from mostovik_pipelines.framework.steps.unchanged import parser_version
from mostovik_pipelines.platform.status import completed_or_partial, record
from mostovik_pipelines.platform.tracking import LOAD_COUNT_KEYS

SHOWN_FAILURES = 5
"""Failed partitions named in a ranged run's failure."""


def _kept_rows(spec: SourceSpec, rejected: tuple[RejectedRow, ...]) -> KeptRows | None:
    """The stored rows the load keeps for the rejected ones: a rejected row is not absent."""
    if not rejected:
        return None
    keys = [row.key for row in rejected if row.key is not None]
    frame = pd.DataFrame(keys, columns=list(spec.natural_key))
    return KeptRows(frame, all_vanished=len(keys) < len(rejected))



@dataclass(frozen=True)
class PartitionLoad:
    """What loading one partition did, for its materialisation and its checks."""

    figures: dict
    received: ReceivedRows
    """Natural key (and version) of every row loaded."""
    received_rows: int
    """Rows the source sent, quarantined ones included."""
    payload_bytes: int
    content_hash: str
    sample: pd.DataFrame | str
    """The first rows loaded (a partition found unchanged: those its parser read, as
    Markdown)."""
    scratch: tuple[str, ...] = ()
    """Kept frames (paged partitions) to discard once the partition is checked."""
    duration_seconds: float = 0.0
    """From the start of the partition's load to its last commit."""
    written_since: datetime | None = None
    """When the partition's one load transaction began (its rows' ``changed_at``); None for a
    paged partition, loaded in several."""


def load_partitions(context: OpExecutionContext, spec: SourceSpec, asset_key: AssetKey,
                    outcomes: StepOutcomes) -> str:
    """Load every partition transform validated, record its materialisation and check results,
    tag the run with its ADR status; the status and figures as one line. A partition that
    fails its load or a blocking check fails the run after the others were loaded."""
    engine = getattr(context.resources, WAREHOUSE_KEY).engine()
    already_loaded = partitions_materialized_by_run(context, asset_key)
    ranged = len(outcomes.partitions) > 1
    skipped, failed = outcomes.skipped(), outcomes.failed()
    loaded_values = [spec.load_target.partition_value(key) for key in already_loaded]
    rejected = 0
    totals: dict[str, int] = {}
    for key, outcome in outcomes.to_load().items():
        if key in already_loaded:
            continue
        loaded = _load_one(context, spec, engine, key, outcome, ranged)
        if isinstance(loaded, PartitionSkipped):
            skipped.append(loaded)
            continue
        if isinstance(loaded, PartitionFailure):
            failed.append(loaded)
            continue
        _record_materialisation(context, asset_key, key, outcome, loaded)
        rejected += loaded.figures["rejected"]
        for name, n in loaded.figures.items():
            if isinstance(n, int):
                totals[name] = totals.get(name, 0) + n
        loaded_values.append(spec.load_target.partition_value(key))
        blocked = _check(context, spec, engine, key, outcome, loaded, loaded_values, ranged)
        if blocked:
            failed.append(blocked)
            continue
        _after_load(context, spec, key, "partial" if loaded.figures["rejected"] else "loaded")
    _record_left_out(context, asset_key, skipped, failed)
    if failed:
        _fail_run(spec, failed, len(outcomes.partitions))
    status = completed_or_partial(rejected, {o.partition_key: o.reason for o in skipped},
                                  ranged=ranged)
    record(context.instance, context.run_id, status)
    figures = ", ".join(f"{name} {n}" for name, n in totals.items() if name in LOAD_COUNT_KEYS)
    return (f"{spec.name}: job {status.value}; {len(outcomes.partitions)} partition(s)"
            + (f"; {figures}" if figures else ""))


def _load_one(context: OpExecutionContext, spec: SourceSpec, engine, key: str,
              outcome: TransformedPartition | TransformedPages | PayloadUnchanged,
              ranged: bool) -> PartitionLoad | PartitionSkipped | PartitionFailure:
    """One partition's load: what it did, or why it was skipped (a newer load superseded it)
    or failed (a ranged run sets the partition aside and goes on; a single one raises). A
    payload found unchanged whose ledger line changed since transform read it is made into
    rows here and loaded as any other."""
    started = time.monotonic()
    step = StepContext(spec.name, key, "load")
    try:
        if isinstance(outcome, PayloadUnchanged):
            confirmed = riding_out(context, step, lambda: _load_unchanged(
                context, spec, engine, key, outcome))
            if confirmed is not None:
                return dataclasses.replace(confirmed,
                                           duration_seconds=time.monotonic() - started)
            context.log.info(f"{spec.name} [{key}]: the ledger changed since transform: the "
                             "payload is made into rows and loaded")
            outcome = transform_partition(context, spec, key, outcome.landed)
            if not isinstance(outcome, TransformedPartition):
                return outcome
        loaded = riding_out(context, step, lambda: (
            _load_pages(context, spec, engine, key, outcome)
            if isinstance(outcome, TransformedPages)
            else _load_whole(context, spec, engine, key, outcome)))
        return dataclasses.replace(loaded, duration_seconds=time.monotonic() - started)
    except PartitionSuperseded as superseded:
        context.log.warning(f"{spec.name} [{key}] superseded: {superseded}")
        return PartitionSkipped(key, f"superseded: {superseded}")
    except Exception as exc:
        return fail_or_set_aside(context, step, spec.load_retry, exc, ranged)


def _record_materialisation(context: OpExecutionContext, asset_key: AssetKey, key: str,
                            outcome: TransformedPartition | TransformedPages,
                            loaded: PartitionLoad) -> None:
    """The materialisation is the partition's line in the run's log, with its figures."""
    context.log_event(AssetMaterialization(
        asset_key=asset_key, partition=key,
        metadata={
            **{name: MetadataValue.int(n) if isinstance(n, int) else n
               for name, n in loaded.figures.items()},
            "duration_seconds": MetadataValue.float(round(loaded.duration_seconds, 3)),
            "payload_bytes": MetadataValue.int(loaded.payload_bytes),
            "content_hash": loaded.content_hash,
            "preview": (MetadataValue.md(loaded.sample) if isinstance(loaded.sample, str)
                        else preview(loaded.sample)),
            **(shape_metadata(outcome.shape) if outcome.shape else {}),
        },
    ))


def _check(context: OpExecutionContext, spec: SourceSpec, engine, key: str,
           outcome: TransformedPartition | TransformedPages, loaded: PartitionLoad,
           loaded_values: list, ranged: bool) -> PartitionFailure | None:
    """Evaluate and record the partition's selected checks; the partition's failure when a
    blocking one did not pass, or when they could not run (the warehouse away past its
    budget): nothing unchecked passes for checked. Their connection is opened right after the
    partition's commit, and a store away then is ridden out like the load's."""
    checked = {check.name for check in context.selected_asset_check_keys}
    step = StepContext(spec.name, key, "check")
    try:
        evaluations = [evaluation for evaluation in riding_out(context, step, lambda: (
            evaluate_partition(engine, spec, key, context.run_id, loaded.received,
                               loaded.received_rows, loaded_values, context.instance,
                               shape=outcome.shape, written_since=loaded.written_since)))
            if evaluation.check_name in checked]
    except Exception as exc:
        return fail_or_set_aside(context, step, NO_RETRY, exc, ranged)
    for evaluation in evaluations:
        context.log_event(evaluation)
    landing = getattr(context.resources, LANDING_KEY)
    for path in loaded.scratch:
        riding_out(context, step, lambda path=path: landing.discard_frame(path))
    blocked = [e for e in evaluations if blocks(e)]
    if not blocked:
        return None
    return fail_or_set_aside(
        context, StepContext(spec.name, key, "check"), NO_RETRY, PartitionCheckFailed(
            "; ".join(f"{e.check_name}: {e.description}" for e in blocked)), ranged)


def _record_left_out(context: OpExecutionContext, asset_key: AssetKey,
                     skipped: list[PartitionSkipped], failed: list[PartitionFailure]) -> None:
    """The partitions skipped and failed, as an observation the job view and the catch-up read
    (the permanently failed ones wait for an operator)."""
    if not (skipped or failed):
        return
    context.log_event(AssetObservation(asset_key=asset_key, metadata={
        "mostovik/skipped": MetadataValue.json({o.partition_key: o.reason for o in skipped}),
        "mostovik/failed": MetadataValue.json({o.partition_key: o.message for o in failed}),
        FAILED_PERMANENTLY_KEY: MetadataValue.json(
            [o.partition_key for o in failed if o.permanent]),
    }))


def _fail_run(spec: SourceSpec, failed: list[PartitionFailure], partitions: int) -> None:
    shown = "; ".join(f.message for f in failed[:SHOWN_FAILURES])
    raise Failure(
        description=f"{spec.name}: {len(failed)} of {partitions} partitions failed: {shown}",
        metadata={"mostovik/failed_partitions": MetadataValue.json(
            [f.partition_key for f in failed])},
        allow_retries=False,
    )


def _after_load(context: OpExecutionContext, spec: SourceSpec, key: str, outcome: str) -> None:
    if spec.after_load is None:
        return
    try:
        spec.after_load(LoadedPartition(spec.name, key,
                                        getattr(context.resources, source_resource_key(spec)),
                                        outcome, context.run_id))
    except Exception as exc:  # the load is committed; what follows it must not undo the job
        context.log.warning(f"{spec.name} [{key}]: after the load: {classify(exc).reason}")


def _load_whole(context: OpExecutionContext, spec: SourceSpec, engine, key: str,
                outcome: TransformedPartition) -> PartitionLoad:
    """One transaction: the partition's rows, its quarantine (rows rejected by transform, and
    rows whose key another partition value holds, when the source rejects those)."""
    quarantined: list[RejectedRow] = []
    frame = outcome.frame

    def quarantine(connection, counts: LoadCounts) -> None:
        quarantined[:] = [*outcome.rejected,
                          *_held_elsewhere(frame, outcome.row_numbers, counts)]
        replace_quarantine(connection, spec.name, key, context.run_id, quarantined)

    counts = load_partition(
        engine, spec.load_target, frame, key, context.run_id,
        within_transaction=quarantine, fetched_at=outcome.landed.fetched_at,
        kept=_kept_rows(spec, outcome.rejected), payload_hash=outcome.landed.content_hash,
        parser_version=parser_version(spec),
    )
    figures = counts.as_dict(merge=spec.load_mode is LoadMode.MERGE_BY_VERSION)
    return PartitionLoad(
        figures={
            **figures, "rejected": len(quarantined),
            "duplicates_dropped": outcome.duplicates_dropped,
            "dagster/row_count": len(frame), "table": spec.table.name,
            "fetched_at": outcome.landed.fetched_at.isoformat(),
        },
        received=ReceivedRows.of(frame, _received_columns(spec)),
        received_rows=len(frame) + len(outcome.rejected),
        payload_bytes=outcome.landed.size_bytes,
        content_hash=outcome.landed.content_hash,
        sample=frame.head(PREVIEW_ROWS),
        written_since=counts.loaded_at,
    )


def _load_unchanged(context: OpExecutionContext, spec: SourceSpec, engine, key: str,
                    outcome: PayloadUnchanged) -> PartitionLoad | None:
    """A partition whose payload is the one its stored rows came from (:mod:`.unchanged`):
    the ledger confirmed under the load's locks, the fence checked, nothing written; its
    figures are the stored rows' and its quarantine's. None: the ledger changed since."""
    quarantined: list[int] = []
    counts = confirm_unchanged(
        engine, spec.load_target, key, context.run_id, content_digest=outcome.content_digest,
        payload_hash=outcome.landed.content_hash, parser_version=outcome.parser_version,
        fetched_at=outcome.landed.fetched_at,
        within_transaction=lambda connection, _: quarantined.append(
            quarantined_count(connection, spec.name, key)))
    if counts is None:
        return None
    rows, rejected = counts.unchanged, quarantined[0]
    return PartitionLoad(
        figures={
            **counts.as_dict(merge=spec.load_mode is LoadMode.MERGE_BY_VERSION),
            "rejected": rejected,
            # What validation dropped: the rows parsed, less those stored and those it rejected.
            "duplicates_dropped": max(
                outcome.parsed_rows - rows - (rejected - outcome.parser_rejected), 0),
            "dagster/row_count": rows, "table": spec.table.name,
            "fetched_at": outcome.landed.fetched_at.isoformat(),
            "payload_unchanged": MetadataValue.bool(True),
        },
        received=ReceivedRows(lambda: iter(())),
        received_rows=rows + rejected,
        payload_bytes=outcome.landed.size_bytes,
        content_hash=outcome.landed.content_hash,
        sample=outcome.preview,
        written_since=counts.loaded_at,
    )


def _received_columns(spec: SourceSpec) -> list[str]:
    """What the checks compare with the table: the natural key, and the version."""
    return [*spec.natural_key, *([spec.version_column] if spec.version_column else [])]


def _held_elsewhere(frame: pd.DataFrame, row_numbers: tuple[int, ...] | None,
                    counts: LoadCounts) -> list[RejectedRow]:
    """The rows the load left out because another partition value holds their keys, numbered
    by their place in the payload."""
    rejected = []
    for held in counts.held_elsewhere:
        key = {k: v for k, v in held.items() if k != "held_by"}
        match = frame.index[(frame[list(key)] == pd.Series(key)).all(axis=1)]
        index = int(match[0]) if len(match) else None
        position = (0 if index is None else row_numbers[index] if row_numbers is not None
                    else index + 1)
        raw = row_text(frame.loc[index]) if index is not None else str(key)
        rejected.append(RejectedRow(
            position, raw, f"key {key} is already held by {held['held_by']}: not overwritten",
            key=None))
    return rejected


def record_window(connection, spec: SourceSpec, key: str, outcome: TransformedPages, rows: int,
                  run_id: str) -> None:
    """A window whose last page commits is loaded: its line in the ledger, in the same
    transaction, so that the ledger names every synced window as it does every other loaded
    partition. Its fetch time is its first page's, and only when this sync started from the
    first page: a window is final once such a sync that started after it closed loaded it."""
    record_load(connection, spec.table.name, spec.load_target.partition_scope(key), rows, None,
                run_id, datetime.now(UTC),
                outcome.fetched_at if outcome.resumed_after_page == 0 else None,
                loaded_partition_key=key, payload_hash=outcome.content_hash)


def _load_pages(context: OpExecutionContext, spec: SourceSpec, engine, key: str,
                outcome: TransformedPages) -> PartitionLoad:
    """Each group of pages in a transaction of its own, with the partition's progress
    checkpoint at the group's last page: the checkpoint never runs ahead of the rows it vouches
    for."""
    landing = getattr(context.resources, LANDING_KEY)
    progress = committed_progress(engine, spec.name, key)
    done = (progress.pages_committed
            if progress is not None and progress.run_id == context.run_id else 0)
    totals: dict[str, int] = {}
    rows = rejected = 0
    sample = None
    for group in outcome.groups:
        rows += group.rows
        rejected += len(group.rejected)
        if group.last_page <= done:
            continue  # committed by this run before its load step was retried
        frame = landing.read_frame(group.frame_path)
        if sample is None:
            sample = frame.head(PREVIEW_ROWS)

        def commit_progress(connection, counts: LoadCounts, group=group,
                            total=rows) -> None:
            replace_quarantine(connection, spec.name, key, context.run_id, group.rejected,
                               append=group.first_page > 1)
            save_progress(connection, spec.name, key, group.last_page,
                          page_cursor(group.next_cursor), context.run_id)
            if group.next_cursor is None:
                record_window(connection, spec, key, outcome, total, context.run_id)

        counts = load_partition(engine, spec.load_target, frame, key, context.run_id,
                                within_transaction=commit_progress, whole_partition=False)
        del frame
        for name, n in counts.as_dict(merge=True).items():
            totals[name] = totals.get(name, 0) + n
    columns = _received_columns(spec)
    paths = tuple(group.frame_path for group in outcome.groups)
    return PartitionLoad(
        figures={
            **{name: totals.get(name, 0) for name in LoadCounts.figures(merge=True)},
            "rejected": rejected, "pages": outcome.pages,
            "resumed_after_page": outcome.resumed_after_page,
            "dagster/row_count": rows, "table": spec.table.name,
            "fetched_at": outcome.fetched_at.isoformat() if outcome.fetched_at else "",
        },
        received=ReceivedRows(lambda: (landing.read_frame(path, columns) for path in paths)),
        received_rows=rows + rejected,
        payload_bytes=outcome.payload_bytes,
        content_hash=outcome.content_hash,
        sample=sample if sample is not None else pd.DataFrame(columns=spec.load_target.columns),
        scratch=paths,
    )
