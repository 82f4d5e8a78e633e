"""The transform op's work: parse each landed payload into rows and validate them; a paged
source's pages in groups of ``rows_per_commit`` rows, each group's rows kept on disk."""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
from dataclasses import dataclass, field

import pandas as pd
from dagster import AssetKey, AssetObservation, OpExecutionContext

from mostovik_pipelines.core.errors import SourceContractError, SourceShapeChanged, classify
from mostovik_pipelines.core.outages import Store, is_away
from mostovik_pipelines.core.retries import NO_RETRY, StepContext
from mostovik_pipelines.framework.assets.resource_keys import LANDING_KEY, WAREHOUSE_KEY
from mostovik_pipelines.framework.quality.shape import (
    ObservedShape,
    ShapeReport,
    judge,
    observation_metadata,
)
from mostovik_pipelines.framework.quality.validation import validate_partition
from mostovik_pipelines.framework.spec import (
    ParsedRows,
    PartitionNotAvailable,
    RejectedRow,
    SourceSpec,
    TransformRequest,
    columns_frame,
)
from mostovik_pipelines.framework.steps.lifecycle import (
    fail_or_set_aside,
    ranged_run,
    riding_out,
)
from mostovik_pipelines.framework.steps.outcomes import (
    LandedPages,
    PartitionFailure,
    PartitionSkipped,
    PayloadUnchanged,
    TransformedPageGroup,
    TransformedPages,
    TransformedPartition,
    page_cursor,
)
from mostovik_pipelines.framework.steps.unchanged import StoredPayloads, stored_payloads, unchanged
from mostovik_pipelines.resources.landing import LandedPayload


def known_payloads(context: OpExecutionContext, spec: SourceSpec) -> StoredPayloads | None:
    """The ledger's lines of the run's partitions (:mod:`.unchanged`), read once as transform
    starts; None where none can be found unchanged, or while the warehouse is away (every
    partition's rows are then made as usual, and its load rides the outage out)."""
    engine = getattr(context.resources, WAREHOUSE_KEY).engine()
    try:
        return stored_payloads(engine, spec, context.partition_keys)
    except Exception as exc:
        if not is_away(Store.WAREHOUSE, exc):
            raise
        context.log.warning(f"{spec.name}: the ledger could not be read ({classify(exc).reason}):"
                            " every payload is made into rows and compared")
        return None


def transform_partition(context: OpExecutionContext, spec: SourceSpec, key: str,
                        landed: LandedPayload | LandedPages, stored: StoredPayloads | None = None,
                        ) -> TransformedPartition | TransformedPages | PayloadUnchanged | (
                            PartitionSkipped | PartitionFailure):
    """The landed payload parsed and validated, riding out the landing store being away; a
    payload ``stored`` says the partition's rows came from, by this code, is parsed (its shape
    judged) but not made into rows again (:mod:`.unchanged`)."""
    return riding_out(context, StepContext(spec.name, key, "transform"),
                      lambda: _transform(context, spec, key, landed, stored))


def _transform(context: OpExecutionContext, spec: SourceSpec, key: str,
               landed: LandedPayload | LandedPages, stored: StoredPayloads | None,
               ) -> (TransformedPartition | TransformedPages | PayloadUnchanged | PartitionSkipped
                     | PartitionFailure):
    if isinstance(landed, LandedPages):
        return _transform_pages(context, spec, key, landed)
    landing = getattr(context.resources, LANDING_KEY)
    ranged = ranged_run(context)
    request = TransformRequest(
        source=spec.name, partition_key=key, content=landing.read(landed),
        content_type=landed.content_type, fetched_at=landed.fetched_at,
    )
    try:
        parsed = spec.transform(request)
    except PartitionNotAvailable as not_yet:
        # What the payload holds is judged all the same: a renamed record element reads as
        # "not published yet" to a parser, and is a change of shape.
        shape_failed = _shape_failure(context, spec, key, request.shapes, ranged)
        if shape_failed:
            return shape_failed
        context.log.info(f"{spec.name} [{key}] not available yet: {not_yet}; "
                         "nothing loaded, a later run will pick it up")
        return PartitionSkipped(key, f"not available yet: {not_yet}")
    except Exception as exc:
        return _shape_failure(context, spec, key, request.shapes, ranged) or fail_or_set_aside(
            context, StepContext(spec.name, key, "transform"), NO_RETRY, exc, ranged)
    shape_failed = _shape_failure(context, spec, key, request.shapes, ranged)
    if shape_failed:
        return shape_failed
    if stored is not None:
        same = unchanged(spec, key, landed, parsed if isinstance(parsed, ParsedRows)
                         else ParsedRows(parsed), _shape_of(spec, request.shapes), stored)
        if same is not None:
            return same
    try:
        validated = validate_partition(parsed, spec.load_target, key, spec.max_rejected_share)
    except Exception as exc:
        return fail_or_set_aside(context, StepContext(spec.name, key, "transform"), NO_RETRY,
                                  exc, ranged)
    if validated.frame.empty and not validated.rejected and spec.empty_payload_is_valid:
        report = _shape_of(spec, request.shapes)
        if report is None or report.observed.records != 0:
            return fail_or_set_aside(context, StepContext(spec.name, key, "transform"),
                                     NO_RETRY, SourceContractError(
                "the payload gave no rows without saying it holds no records (its transform "
                "reports no shape, or records it did not read): nothing is loaded, the "
                "partition is not an empty period"), ranged)
    if validated.rejected:
        context.log.warning(
            f"{spec.name} [{key}]: {len(validated.rejected)} rows rejected to quarantine, "
            f"first: row {validated.rejected[0].row_number}: {validated.rejected[0].reason}"
        )
    return TransformedPartition.of(
        validated.frame, landed, validated.duplicates_dropped, validated.rejected,
        None if validated.row_numbers is None else tuple(validated.row_numbers.tolist()),
        shape=_shape_of(spec, request.shapes))


def _shape_of(spec: SourceSpec, shapes: list[ObservedShape]) -> ShapeReport | None:
    if spec.shape is None:
        return None
    return judge(spec.name, spec.shape, spec.added_field_policy, shapes)


def _shape_failure(context: OpExecutionContext, spec: SourceSpec, key: str,
                   shapes: list[ObservedShape], ranged: bool) -> PartitionFailure | None:
    """Record a partition whose shape differs from the declaration (an observation of the
    partition, what the UI shows and the shape alert reads); fail it as a contract error when
    the declaration's policy says so. A changed shape is named as such, before whatever the
    parse made of it."""
    report = _shape_of(spec, shapes)
    if report is None or not report.drift:
        return None
    context.log_event(AssetObservation(asset_key=AssetKey(spec.name), partition=key,
                                       metadata=observation_metadata(report)))
    if not report.breaks:
        context.log.warning(f"{spec.name} [{key}]: {report.drift.describe()} (policy "
                            f"{report.policy.value}: loaded as usual)")
        return None
    declaration = f"mostovik_pipelines/sources/{spec.name}/source.py"
    return fail_or_set_aside(context, StepContext(spec.name, key, "transform"), NO_RETRY,
                             SourceShapeChanged(report.message(declaration)), ranged)


def _transform_pages(context: OpExecutionContext, spec: SourceSpec, key: str,
                     landed: LandedPages) -> TransformedPages | PartitionFailure:
    """Parse every landed page and validate them in groups of ``rows_per_commit`` rows, each
    group's rows kept on disk for the load: memory holds one group, never the window. Rows are
    numbered by their place among the items this run received for the window; a quarantined
    row's reason names its page."""
    landing = getattr(context.resources, LANDING_KEY)
    groups: list[TransformedPageGroup] = []
    group = PageGroup()
    received = 0
    digest = hashlib.sha256()
    ranged = ranged_run(context)
    seen: ObservedShape | None = None
    drift_recorded = False
    for position, page in enumerate(landed.pages, 1):
        number = page.page or position
        request = TransformRequest(
            source=spec.name, partition_key=key, content=landing.read(page),
            content_type=page.content_type, fetched_at=page.fetched_at,
            cursor=page_cursor(page.cursor),
        )
        try:
            parsed = spec.transform(request)
        except Exception as exc:
            seen = _merged(seen, request.shapes)
            return _shape_failure(context, spec, key, [seen] if seen else [], ranged) or (
                fail_or_set_aside(
                    context, StepContext(spec.name, key, f"transform (page {number})"),
                    NO_RETRY, exc, ranged))
        # The window's shape so far (a page's few sampled records alone could mislead),
        # judged at every page; a drift within the policy is recorded once.
        seen = _merged(seen, request.shapes)
        report = _shape_of(spec, [seen] if seen else [])
        if report is not None and report.drift and (report.breaks or not drift_recorded):
            drift_recorded = True
            shape_failed = _shape_failure(context, spec, key, [seen], ranged)
            if shape_failed:
                return shape_failed
        received = group.add(number, parsed, received)
        digest.update(page.content_hash.encode())
        if group.rows < spec.rows_per_commit and position < len(landed.pages):
            continue
        pages = f"pages {group.first_page}-{number}" if group.first_page != number else (
            f"page {number}")
        try:
            validated = validate_partition(group.parsed(), spec.load_target, key,
                                           spec.max_rejected_share)
        except Exception as exc:
            return fail_or_set_aside(
                context, StepContext(spec.name, key, f"transform ({pages})"), NO_RETRY, exc,
                ranged_run(context))
        groups.append(TransformedPageGroup(
            group.first_page, number, landing.keep_frame(page, validated.frame),
            len(validated.frame), group.on_their_pages(validated.rejected),
            validated.duplicates_dropped, page.next_cursor))
        group = PageGroup()
    if any(g.rejected for g in groups):
        first = next(r for g in groups for r in g.rejected)
        context.log.warning(
            f"{spec.name} [{key}]: {sum(len(g.rejected) for g in groups)} rows rejected to "
            f"quarantine, first: row {first.row_number}: {first.reason}")
    return TransformedPages(
        tuple(groups), landed.resumed_after_page, len(landed.pages),
        sum(page.size_bytes for page in landed.pages), digest.hexdigest(),
        landed.pages[0].fetched_at if landed.pages else None,
        shape=_shape_of(spec, [seen] if seen else []))


def _merged(seen: ObservedShape | None, shapes: list[ObservedShape]) -> ObservedShape | None:
    for shape in shapes:
        seen = shape if seen is None else seen.merged(shape)
    return seen


@dataclass
class PageGroup:
    """Pages parsed, not yet validated: their rows, row numbers and rejected rows."""

    first_page: int = 0
    rows: int = 0
    frames: list = field(default_factory=list)
    columns: dict[str, list] | None = None
    """Rows of the latest pages given as columns, not yet a frame: one frame per group."""
    numbers: list = field(default_factory=list)
    rejected: list = field(default_factory=list)
    starts: list = field(default_factory=list)
    """(first row number, page number) of each page, to tell which page a row came from."""

    def add(self, page: int, parsed, received: int) -> int:
        """Take a parsed page whose rows are numbered from ``received`` + 1; returns the
        numbering's next start."""
        parsed = parsed if isinstance(parsed, ParsedRows) else ParsedRows(parsed)
        rows = parsed.frame
        if isinstance(rows, pd.DataFrame):
            self._columns_to_frame()
            self.frames.append(rows)
            count = len(rows)
        else:
            if self.columns is not None and list(self.columns) != list(rows):
                self._columns_to_frame()
            if self.columns is None:
                self.columns = {name: [] for name in rows}
            for name, values in rows.items():
                self.columns[name].extend(values)
            count = len(next(iter(rows.values()), ()))
        local = (list(parsed.row_numbers) if parsed.row_numbers is not None
                 else list(range(1, count + 1)))
        self.first_page = self.first_page or page
        self.rows += count
        self.numbers += [received + n for n in local]
        self.rejected += [dataclasses.replace(r, row_number=received + r.row_number)
                          for r in parsed.rejected]
        self.starts.append((received + 1, page))
        return received + max(count + len(parsed.rejected), *local,
                              *(r.row_number for r in parsed.rejected), 0)

    def _columns_to_frame(self) -> None:
        if self.columns is not None:
            self.frames.append(columns_frame(self.columns))
            self.columns = None

    def parsed(self) -> ParsedRows:
        self._columns_to_frame()
        frame = (pd.concat(self.frames, ignore_index=True) if len(self.frames) > 1
                 else self.frames[0].reset_index(drop=True))
        return ParsedRows(frame, self.rejected, self.numbers)

    def on_their_pages(self, rejected: tuple[RejectedRow, ...]) -> tuple[RejectedRow, ...]:
        firsts = [start for start, _ in self.starts]

        def page_of(row: RejectedRow) -> int:
            return self.starts[max(bisect.bisect_right(firsts, row.row_number) - 1, 0)][1]

        return tuple(dataclasses.replace(row, reason=f"page {page_of(row)}: {row.reason}")
                     for row in rejected)
