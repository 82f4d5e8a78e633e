"""The op-output storage's and the landing store's retention.

Op outputs (``<storage>/<run_id>/<step>/<output>``, pickles handed from step to step) are only
ever read by a later step of their run or by a re-execution of it. Landed payloads
(``<landing>/<source>/<partition>/``: ``fetches/*.json`` records, ``blobs/<sha256>.bin``
contents, ``frames/<run>-p<page>.pickle`` scratch) are history, except a partition's latest
and the one its stored rows came from (``reuse_landed`` re-transforms it, and it is older than the
latest when a later fetch was rejected), and what a run that may still be re-executed landed.

A directory or blob is removed in two moves: renamed aside (``.pruning-...``), then deleted, so
a prune killed between the two leaves a name no reader opens, which the next prune deletes. On
object storage (:mod:`mostovik_pipelines.resources.stores`: the same calls, through the same
interface) a blob is moved aside the same way (a copy, then a removal); a run's op outputs are
deleted in place, object by object, since a rename would copy them all: a prune killed half way
leaves the rest of a run the policy already gave up, which the next prune finds and removes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime

from dagster import DagsterInstance

from mostovik_pipelines.framework.assets.stored_payload import stored_payload_hashes
from mostovik_pipelines.maintenance.policy import LANDING, OP_OUTPUTS, Removal, RetentionPolicy
from mostovik_pipelines.maintenance.runs import RunFacts
from mostovik_pipelines.resources.landing import (
    LandedPayload,
    fetch_record_of,
    fetch_records,
    latest_fetch_record,
    read_fetch_record,
)
from mostovik_pipelines.resources.stores import StorePath, move, on_object_store, remove_tree

RUN_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
DETACHED = ".pruning-"


def stale_op_outputs(base_dir: StorePath, facts: RunFacts, policy: RetentionPolicy,
                     now: datetime) -> list[Removal]:
    """Op outputs of a run no recovery path can use any more: a successful run's after the
    grace (a run is only re-executed whole), a failed run's once it may no longer be
    re-executed from its failure (``keep_failed_run_outputs``), and the outputs of runs run
    storage no longer knows after the grace (a run deleted, a test run on a shared path)."""
    removals = []
    for path in _children(base_dir):
        if path.name.startswith(DETACHED):
            removals.append(Removal(OP_OUTPUTS, str(path), _size(path),
                                    lambda path=path: remove_tree(path)))
            continue
        if not RUN_ID.match(path.name) or not path.is_dir():
            continue  # not a run's outputs (an asset's would be named after it): not ours
        if path.name in facts.records:
            if facts.outputs_needed(path.name, policy, now):
                continue
        elif _modified(path) > now - policy.grace:
            continue
        removals.append(Removal(OP_OUTPUTS, str(path), _size(path),
                                lambda path=path: _remove_tree(path)))
    return removals


def old_fetch_records(base_dir: StorePath, facts: RunFacts, policy: RetentionPolicy,
                      now: datetime, stored: StoredPayloads) -> list[Removal]:
    """Fetch records older than ``keep_landed``, except each partition's latest (picked as
    :meth:`LandingStoreResource.latest` picks it), the one its stored rows came from (what
    ``reuse_landed`` re-transforms; older than the latest when a later fetch was rejected), and
    those of runs a recovery path may still use (a sync resumes from a stopped run's pages)."""
    removals = []
    for partition in _partitions(base_dir):
        fetches = partition / "fetches"
        latest = latest_fetch_record(fetches)
        if latest is None:
            continue
        kept = {latest, stored.record_behind_rows(fetches, read_fetch_record(latest))}
        for record in fetch_records(fetches):
            if record in kept or _modified(record) > now - policy.keep_landed:
                continue
            if facts.outputs_needed(read_fetch_record(record).run_id, policy, now):
                continue
            removals.append(Removal(LANDING, str(record), _size(record),
                                    lambda record=record: record.unlink(missing_ok=True)))
    return removals


class StoredPayloads:
    """The content hash of the payload behind each loaded partition's stored rows, read from
    the instance once per source, when a partition of it has fetches to consider."""

    def __init__(self, instance: DagsterInstance) -> None:
        self._instance = instance
        self._by_source: dict[str, dict[str, str]] = {}

    def record_behind_rows(self, fetches: StorePath,
                           latest: LandedPayload) -> StorePath | None:
        """The partition's fetch record its stored rows came from (``latest``: its latest
        record, which names the source and the partition in full)."""
        if latest.source not in self._by_source:
            self._by_source[latest.source] = stored_payload_hashes(self._instance, latest.source)
        content_hash = self._by_source[latest.source].get(latest.partition_key)
        return fetch_record_of(fetches, content_hash) if content_hash else None


def unreferenced_blobs(base_dir: StorePath, removed_records: set[str], policy: RetentionPolicy,
                       now: datetime) -> list[Removal]:
    """Blobs no remaining fetch record points to: content nobody can reach. One written within
    the grace is left alone (a fetch lands its blob just before its record)."""
    removals = []
    for partition in _partitions(base_dir):
        referenced = {read_fetch_record(record).content_hash
                      for record in fetch_records(partition / "fetches")
                      if str(record) not in removed_records}
        for blob in _children(partition / "blobs"):
            if blob.name.startswith(DETACHED):
                removals.append(Removal(LANDING, str(blob), _size(blob),
                                        lambda blob=blob: blob.unlink(missing_ok=True)))
            elif (blob.suffix == ".bin" and blob.stem not in referenced
                  and _modified(blob) <= now - policy.grace):
                removals.append(Removal(LANDING, str(blob), _size(blob),
                                        lambda blob=blob: _remove_blob(blob)))
    return removals


def stale_frames(base_dir: StorePath, facts: RunFacts, policy: RetentionPolicy,
                 now: datetime) -> list[Removal]:
    """Validated pages a load step keeps beside its pages until it is done with them: scratch
    of its run. A finished run's are left over (a killed or failed load); a re-execution
    fetches its partitions again and never reads them."""
    removals = []
    for partition in _partitions(base_dir):
        for frame in _children(partition / "frames"):
            run_id = frame.name.rsplit("-p", 1)[0]
            if run_id in facts.records:
                if not facts.finished(run_id) or run_id in facts.in_use:
                    continue
            elif _modified(frame) > now - policy.grace:
                continue
            removals.append(Removal(LANDING, str(frame), _size(frame),
                                    lambda frame=frame: frame.unlink(missing_ok=True)))
    return removals


def _remove_blob(blob: StorePath) -> None:
    """Rename the blob aside, then delete it unless a fetch record names it by now (a fetch of
    the same bytes landing meanwhile): then it goes back. A fetch whose record was written
    after that look finds its blob gone and lands it again (:meth:`LandingStoreResource.land`)."""
    detached = blob.with_name(f"{DETACHED}{blob.name}")
    try:
        move(blob, detached)
    except FileNotFoundError:
        return
    records = fetch_records(blob.parent.parent / "fetches")
    if any(read_fetch_record(record).content_hash == blob.stem for record in records
           if blob.stem[:12] in record.name):
        move(detached, blob)
    else:
        detached.unlink(missing_ok=True)


def _remove_tree(path: StorePath) -> None:
    if on_object_store(path):
        remove_tree(path)
        return
    detached = path.with_name(f"{DETACHED}{path.name}")
    try:
        move(path, detached)
    except FileNotFoundError:
        return
    remove_tree(detached)


def _partitions(base_dir: StorePath) -> Iterator[StorePath]:
    for source in _children(base_dir):
        yield from (partition for partition in _children(source) if partition.is_dir())


def _children(folder: StorePath) -> list[StorePath]:
    try:
        return sorted(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _modified(path: StorePath) -> datetime:
    """When ``path`` was last written; one removed meanwhile (a load step discarding its frame)
    counts as written now, so it is left alone. A folder on object storage is a prefix with no
    time of its own: its newest object's."""
    try:
        if on_object_store(path) and path.is_dir():
            times = [child.stat().st_mtime for child in path.rglob("*") if child.is_file()]
            if not times:
                raise FileNotFoundError(str(path))  # an empty prefix is no folder at all
            return datetime.fromtimestamp(max(times), UTC)
        return datetime.fromtimestamp(path.stat().st_mtime, UTC)
    except FileNotFoundError:
        return datetime.now(UTC).replace(year=9999)


def _size(path: StorePath) -> int:
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(child.stat().st_size for child in path.rglob("*") if child.is_file())
    except FileNotFoundError:
        return 0
