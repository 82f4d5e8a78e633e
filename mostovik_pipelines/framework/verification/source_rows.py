"""What the source says for a partition, parsed and validated as a load would, written nowhere.

* :func:`from_source` asks the source again through its own resource (the same client, its
  rate-limit handling and timeouts), retrying transient failures with the source's extract
  retry policy as a run's step would, and walking a sync's pages by cursor (an expired page
  token restarts the page after the last item received). Nothing it answers is landed.
* :func:`from_landing` re-reads the payload the stored rows came from: the ledger names it
  (``partition_loads.payload_hash``; a sync window: the pages its loading run landed, checked
  against the same hash), the landing store keeps it. No request leaves the machine.

Either way the bytes go through the source's transform, the shape judgement and the
framework's validation, as in :mod:`..steps.transform`: the rows a load would write, the rows it
would quarantine. A file source's "source" is the file as the inbox holds it now: an upload
under the same name since the load (a corrected report) is what the table is compared with.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import pandas as pd

from mostovik_pipelines.core.errors import PageCursorExpired, classify
from mostovik_pipelines.framework.load.ledger import LedgerEntry
from mostovik_pipelines.framework.quality.shape import ObservedShape, judge
from mostovik_pipelines.framework.quality.validation import validate_partition
from mostovik_pipelines.framework.spec import (
    ExtractRequest,
    JobType,
    PageCursor,
    ParsedRows,
    PartitionNotAvailable,
    RejectedRow,
    SourceSpec,
    TransformRequest,
)
from mostovik_pipelines.framework.steps.outcomes import page_cursor
from mostovik_pipelines.framework.steps.transform import PageGroup
from mostovik_pipelines.resources.inbox import InboxResource, version_key
from mostovik_pipelines.resources.landing import LandingStoreResource

EXPIRED_TOKENS_IN_A_ROW = 10
"""Expired page tokens in a row after which a sync's page is given up (the step's own walk
restarts forever; a verification is asked for by a person, who should hear about it)."""

T = TypeVar("T")


class Unverifiable(Exception):
    """The partition cannot be compared: the source stays down, its payload is gone, or what
    it sends would not load (a changed shape, a systematic defect). The message says which."""


@dataclass(frozen=True)
class SourceRows:
    """What the source says for one partition."""

    partition_key: str
    """The partition the rows are for: the one asked about, or (a file source) the version the
    inbox holds now under its name."""
    frame: pd.DataFrame | None
    """The rows a load would write; None when the source has not published the partition."""
    rejected: tuple[RejectedRow, ...] = ()
    """The rows a load would quarantine."""
    payload: str = ""
    """What was read: the payload's hash (12 characters) and where it came from."""
    not_available: str | None = None


def from_source(spec: SourceSpec, resource: Any, key: str,
                sleep: Callable[[float], None] = time.sleep) -> SourceRows:
    """Ask the source for partition ``key`` again; land nothing."""
    now = datetime.now(UTC)
    if spec.paged:
        return _pages_from_source(spec, resource, key, now, sleep)
    asked = _current_file_version(spec, resource, key)
    raw = _with_retries(spec, key, sleep, lambda: spec.extract(ExtractRequest(
        source=spec.name, partition_key=asked, resource=resource)))
    digest = hashlib.sha256(raw.content).hexdigest()
    return _parsed(spec, asked, [_transform(spec, asked, raw.content, raw.content_type,
                                            raw.published_at or now)],
                   f"{digest[:12]} from {raw.origin or spec.name}")


def from_landing(spec: SourceSpec, landing: LandingStoreResource, key: str,
                 loaded: LedgerEntry, payload_hash: str | None) -> SourceRows:
    """Re-read the payload behind the partition's stored rows (``payload_hash``: the ledger's,
    or the latest materialisation's for a load recorded before the ledger kept it)."""
    if payload_hash is None:
        raise Unverifiable(f"{spec.name} [{key}]: the ledger does not name the payload of its "
                           f"last load (run {loaded.loaded_by_run}, before payloads were "
                           "recorded): verify it against the source")
    if spec.paged:
        return _pages_from_landing(spec, landing, key, loaded, payload_hash)
    payload = landing.landed_with(spec.name, key, payload_hash)
    if payload is None or not landing.is_whole(payload):
        raise Unverifiable(
            f"{spec.name} [{key}]: the payload the stored rows came from (content hash "
            f"{payload_hash[:12]}) is no longer in the landing store: verify it against the "
            "source")
    content = landing.read(payload)
    return _parsed(spec, key, [_transform(spec, key, content, payload.content_type,
                                          payload.fetched_at)],
                   f"{payload_hash[:12]} landed {payload.fetched_at.isoformat(timespec='seconds')}")


# --- fetching ---------------------------------------------------------------------------------


def _with_retries(spec: SourceSpec, key: str, sleep: Callable[[float], None],
                  call: Callable[[], T]) -> T:
    """``call`` retried as the extract step retries it: transient failures, up to the source's
    attempts, with its backoff (or the wait a rate limit asks for)."""
    policy = spec.extract_retry
    attempt = 1
    while True:
        try:
            return call()
        except PageCursorExpired:
            raise
        except Exception as exc:
            verdict = classify(exc)
            if not verdict.retried_by_step or attempt >= policy.max_attempts:
                raise Unverifiable(
                    f"{spec.name} [{key}]: the source could not be read after {attempt} "
                    f"attempt(s) ({verdict.kind}: {verdict.reason})") from exc
            sleep(policy.wait_seconds(attempt, verdict.retry_after))
            attempt += 1


def _current_file_version(spec: SourceSpec, resource: Any, key: str) -> str:
    """A file source: the version of the partition's file that the inbox holds now (an upload
    under the same name since the load), else ``key`` itself (read from the archive)."""
    if spec.job_type is not JobType.FILE or not isinstance(resource, InboxResource):
        return key
    name = str(spec.load_target.partition_value(key))
    if not any(file.name == name for file in resource.files()):
        return key
    try:
        return version_key(name, resource.content_hash(name))
    except OSError:
        return key


def _pages_from_source(spec: SourceSpec, resource: Any, key: str, now: datetime,
                       sleep: Callable[[float], None]) -> SourceRows:
    group = PageGroup()
    shapes: list[ObservedShape] = []
    received = 0
    cursor: PageCursor | None = None
    number, expired, digest = 1, 0, hashlib.sha256()
    while True:
        try:
            raw = _with_retries(spec, key, sleep, lambda cursor=cursor: spec.extract(
                ExtractRequest(source=spec.name, partition_key=key, resource=resource,
                               cursor=cursor)))
        except PageCursorExpired as exc:
            expired += 1
            if expired >= EXPIRED_TOKENS_IN_A_ROW:
                raise Unverifiable(f"{spec.name} [{key}] page {number}: {exc}") from exc
            cursor = PageCursor(None, cursor.resume_after if cursor else None)
            continue
        expired = 0
        digest.update(hashlib.sha256(raw.content).hexdigest().encode())
        parsed = _transform(spec, key, raw.content, raw.content_type, now, cursor, shapes)
        if parsed is None:
            return SourceRows(key, None, payload=f"page {number}",
                              not_available=f"page {number} not available yet")
        received = group.add(number, parsed, received)
        if raw.next_cursor is None:
            break
        cursor, number = raw.next_cursor, number + 1
    return _validated_pages(spec, key, group, shapes,
                            f"{number} page(s), {digest.hexdigest()[:12]}, from the source")


def _pages_from_landing(spec: SourceSpec, landing: LandingStoreResource, key: str,
                        loaded: LedgerEntry, payload_hash: str) -> SourceRows:
    pages = landing.pages_landed_by(spec.name, key, loaded.loaded_by_run)
    gone = f"{spec.name} [{key}]: the pages the window was loaded from (run " \
           f"{loaded.loaded_by_run}, hash {payload_hash[:12]})"
    if not pages or (pages[0].page or 1) != 1:
        raise Unverifiable(f"{gone} are not all in the landing store (a sync resumed after "
                           "an earlier run, or pruned): verify it against the source")
    digest = hashlib.sha256()
    for page in pages:
        digest.update(page.content_hash.encode())
    if digest.hexdigest() != payload_hash or not all(landing.is_whole(p) for p in pages):
        raise Unverifiable(f"{gone} are not whole in the landing store: verify it against the "
                           "source")
    group = PageGroup()
    shapes: list[ObservedShape] = []
    received = 0
    for page in pages:
        parsed = _transform(spec, key, landing.read(page), page.content_type, page.fetched_at,
                            page_cursor(page.cursor), shapes)
        if parsed is None:
            raise Unverifiable(f"{gone}: page {page.page} now parses as not available")
        received = group.add(page.page or 1, parsed, received)
    return _validated_pages(spec, key, group, shapes,
                            f"{len(pages)} page(s), {payload_hash[:12]}, landed by run "
                            f"{loaded.loaded_by_run[:8]}")


# --- parsing and validating, as a load would ----------------------------------------------------


def _transform(spec: SourceSpec, key: str, content: bytes, content_type: str,
               fetched_at: datetime, cursor: PageCursor | None = None,
               shapes: list[ObservedShape] | None = None) -> ParsedRows | None:
    """The source's transform of one payload (None: not available yet); a shape the
    declaration's policy refuses, or a payload that does not parse, is unverifiable, as it
    would fail the load."""
    request = TransformRequest(source=spec.name, partition_key=key, content=content,
                               content_type=content_type, fetched_at=fetched_at, cursor=cursor)
    try:
        parsed = spec.transform(request)
    except PartitionNotAvailable:
        return None
    except Exception as exc:
        _refuse_changed_shape(spec, key, [*(shapes or []), *request.shapes])
        raise Unverifiable(f"{spec.name} [{key}]: {classify(exc).reason}") from exc
    if shapes is not None:
        shapes.extend(request.shapes)
    else:
        _refuse_changed_shape(spec, key, request.shapes)
    return parsed if isinstance(parsed, ParsedRows) else ParsedRows(parsed)


def _refuse_changed_shape(spec: SourceSpec, key: str, shapes: list[ObservedShape]) -> None:
    if spec.shape is None or not shapes:
        return
    report = judge(spec.name, spec.shape, spec.added_field_policy, shapes)
    if report is not None and report.breaks:
        raise Unverifiable(f"{spec.name} [{key}]: " + report.message(
            f"mostovik_pipelines/sources/{spec.name}/source.py"))


def _parsed(spec: SourceSpec, key: str, parsed: list[ParsedRows | None],
            payload: str) -> SourceRows:
    (rows,) = parsed
    if rows is None:
        return SourceRows(key, None, payload=payload, not_available="not available yet")
    return _validated(spec, key, rows, payload)


def _validated_pages(spec: SourceSpec, key: str, group: PageGroup,
                     shapes: list[ObservedShape], payload: str) -> SourceRows:
    _refuse_changed_shape(spec, key, shapes)
    if not group.starts:
        return SourceRows(key, pd.DataFrame(columns=spec.load_target.columns), payload=payload)
    return _validated(spec, key, group.parsed(), payload,
                      on_their_pages=group.on_their_pages)


def _validated(spec: SourceSpec, key: str, parsed: ParsedRows, payload: str,
               on_their_pages: Callable[[tuple[RejectedRow, ...]], tuple[RejectedRow, ...]]
               | None = None) -> SourceRows:
    try:
        validated = validate_partition(parsed, spec.load_target, key, spec.max_rejected_share)
    except Exception as exc:
        raise Unverifiable(f"{spec.name} [{key}]: {classify(exc).reason}") from exc
    rejected = on_their_pages(validated.rejected) if on_their_pages else validated.rejected
    return SourceRows(key, validated.frame, tuple(rejected), payload)
