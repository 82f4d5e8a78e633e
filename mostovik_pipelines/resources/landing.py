"""The landing store: raw payloads exactly as received, so a partition can be re-transformed
without calling the source again.

Layout under ``base_dir``::

    <source>/<partition>/blobs/<sha256>.bin          content, stored once per distinct hash
    <source>/<partition>/fetches/<fetched_at>-<hash12>.json   one record per fetch
    <source>/<partition>/fetches/<fetched_at>-<hash12>-<run>-p<page>.json   a page's fetch
    <source>/<partition>/frames/<run>-p<page>.pickle   a group of pages' validated rows, until
                                                       the load step is done with them

``base_dir`` is a directory or an ``s3://bucket/prefix`` (:mod:`.stores`): the same layout,
read and written through the same calls. Writes are whole or nothing (on a disk a temporary file,
then a rename; on object storage one upload), so a process killed mid-write leaves no torn file
behind. On a disk a whole payload is also flushed (``fsync``) before it counts as landed; a page
of a sync is not (``durable=False``): a page is cheap to fetch again, the sync's progress lives in
the warehouse, and a thousand pages would otherwise spend more time in ``fsync`` than in HTTP. In
a distributed deployment ``base_dir`` is a bucket, or a path every worker can reach. Every path
here is made by :func:`.stores.store_path` (a ``blob_path`` is a path or an ``s3://`` URL), never
by ``Path()``, and written by :func:`.stores.write_whole`: one class serves both kinds of store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import quote

from dagster import ConfigurableResource

from mostovik_pipelines.core.errors import PermanentError
from mostovik_pipelines.resources.stores import StorePath, store_path, write_whole


@dataclass(frozen=True)
class LandedPayload:
    """A reference to one landed fetch: small enough to pass between ops."""

    source: str
    partition_key: str
    content_hash: str
    content_type: str
    fetched_at: datetime
    size_bytes: int
    origin: str
    blob_path: str
    run_id: str = ""
    """The run that fetched it: a retried step resumes with what its own run already landed."""
    page: int | None = None
    """Paged sources: the page's number within the partition's sync (1 = first page)."""
    cursor: dict | None = None
    """Paged sources: the cursor the page was fetched with (token, resume_after)."""
    next_cursor: dict | None = None
    """Paged sources: where the next page starts; None after the last page."""


class LandingStoreResource(ConfigurableResource):
    """The landing store rooted at ``base_dir``: a directory or ``s3://bucket/prefix``."""

    base_dir: str

    def land(
        self, source: str, partition_key: str, content: bytes, *, content_type: str,
        origin: str, fetched_at: datetime, run_id: str = "", page: int | None = None,
        cursor: dict | None = None, next_cursor: dict | None = None, durable: bool = True,
    ) -> LandedPayload:
        """Keep ``content`` and record the fetch; identical content is stored once.
        ``durable=False`` skips flushing it to disk (a sync's page). A run that lost its claim
        lands nothing (:func:`.platform.claims.ensure_run_claim`)."""
        # Imported here: the claims bring psycopg, which loading the code location must not.
        from mostovik_pipelines.platform.claims import ensure_run_claim

        ensure_run_claim(run_id)
        content_hash = hashlib.sha256(content).hexdigest()
        folder = self._partition_dir(source, partition_key)
        blob = folder / "blobs" / f"{content_hash}.bin"
        if not blob.exists():
            write_whole(blob, content, durable)
        payload = LandedPayload(
            source=source, partition_key=partition_key, content_hash=content_hash,
            content_type=content_type, fetched_at=fetched_at, size_bytes=len(content),
            origin=origin, blob_path=str(blob), run_id=run_id, page=page, cursor=cursor,
            next_cursor=next_cursor,
        )
        name = f"{fetched_at:%Y%m%dT%H%M%S%fZ}-{content_hash[:12]}"
        if page is not None:
            name += f"-{run_id}-p{page:07d}"
        record = folder / "fetches" / f"{name}.json"
        # Fields one level deep (``asdict`` deep-copies every cursor: a tenth of a sync's
        # landing time).
        fields = {f.name: getattr(payload, f.name) for f in dataclasses.fields(payload)}
        write_whole(record, json.dumps(fields, default=str).encode(), durable)
        if not blob.exists():
            # The retention prune took the blob away while no record named it (it detaches a
            # blob, then looks for a record): land it again, now that the record names it.
            write_whole(blob, content, durable)
        return payload

    def read(self, payload: LandedPayload) -> bytes:
        """The landed bytes, checked against their hash."""
        content = store_path(payload.blob_path).read_bytes()
        if hashlib.sha256(content).hexdigest() != payload.content_hash:
            raise PermanentError(
                f"landed payload {payload.blob_path} does not match its hash {payload.content_hash}"
            )
        return content

    def latest(self, source: str, partition_key: str) -> LandedPayload | None:
        """The most recent fetch landed for the partition, if any."""
        path = latest_fetch_record(self._partition_dir(source, partition_key) / "fetches")
        return _record(path) if path else None

    def landed_with(self, source: str, partition_key: str,
                    content_hash: str) -> LandedPayload | None:
        """The most recent whole-payload fetch of the partition with this content, if any (the
        payload a partition's stored rows came from, which may be older than the latest)."""
        path = fetch_record_of(self._partition_dir(source, partition_key) / "fetches",
                               content_hash)
        return _record(path) if path else None

    def pages_landed_by(self, source: str, partition_key: str,
                        run_id: str) -> list[LandedPayload]:
        """The pages ``run_id`` landed for the partition, in page order."""
        folder = self._partition_dir(source, partition_key) / "fetches"
        pages = [_record(path) for path in folder.glob(f"*-{run_id}-p*.json")]
        return sorted(pages, key=lambda landed: landed.page or 0)

    def is_whole(self, payload: LandedPayload) -> bool:
        """Whether the landed bytes are there and match their hash (a machine that crashed may
        leave a page written but not flushed)."""
        try:
            content = store_path(payload.blob_path).read_bytes()
        except OSError:
            return False
        return hashlib.sha256(content).hexdigest() == payload.content_hash

    def keep_frame(self, page: LandedPayload, frame) -> str:
        """Keep the validated rows of a group of pages ending with ``page`` (a pandas frame)
        beside them until the load step is done, so that a paged partition is never held in
        memory whole. Scratch, not history: not flushed to disk."""
        # Imported here: the claims bring psycopg, which loading the code location must not.
        from mostovik_pipelines.platform.claims import ensure_run_claim

        ensure_run_claim(page.run_id)
        path = (store_path(page.blob_path).parent.parent / "frames"
                / f"{page.run_id}-p{page.page or 0:07d}.pickle")
        write_whole(path, pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL),
                          durable=False)
        return str(path)

    def read_frame(self, path: str, columns: list[str] | None = None):
        frame = pickle.loads(store_path(path).read_bytes())
        return frame if columns is None else frame[columns]

    def discard_frame(self, path: str) -> None:
        store_path(path).unlink(missing_ok=True)

    def _partition_dir(self, source: str, partition_key: str) -> StorePath:
        return store_path(self.base_dir) / quote(source, safe="") / _folder_name(partition_key)


MAX_FOLDER_NAME = 200
"""Bytes of a partition's folder name: file systems allow 255, and a percent-encoded Cyrillic
file name (a file version's key) takes 6 bytes a letter."""


def _folder_name(partition_key: str) -> str:
    """The partition key, percent-encoded; a long one is cut and ends with a hash of the whole
    key, so it stays unique (the landing records keep the full key)."""
    name = quote(partition_key, safe="")
    if len(name) <= MAX_FOLDER_NAME:
        return name
    digest = hashlib.sha256(partition_key.encode()).hexdigest()[:16]
    return f"{name[:MAX_FOLDER_NAME - 17].rstrip('%')}~{digest}"


def fetch_records(fetches_dir: StorePath) -> list[StorePath]:
    """A partition's fetch records, oldest first: named by fetch time, so the name orders them
    (a file being written, ``.tmp-...``, is none)."""
    return sorted(path for path in fetches_dir.glob("*.json") if not path.name.startswith("."))


def latest_fetch_record(fetches_dir: StorePath) -> StorePath | None:
    """The record :meth:`LandingStoreResource.latest` reads: what ``reuse_landed``
    re-transforms, and what the retention prune always keeps."""
    records = fetch_records(fetches_dir)
    return records[-1] if records else None


def fetch_record_of(fetches_dir: StorePath, content_hash: str) -> StorePath | None:
    """The latest record of a whole-payload fetch of ``content_hash``: what
    :meth:`LandingStoreResource.landed_with` reads, and what the retention prune keeps while
    the partition's stored rows come from it."""
    matching = [path for path in fetch_records(fetches_dir)
                if path.stem.endswith(f"-{content_hash[:12]}")
                and read_fetch_record(path).content_hash == content_hash]
    return matching[-1] if matching else None


def read_fetch_record(path: StorePath) -> LandedPayload:
    """One fetch record."""
    return _record(path)


def _record(path: StorePath) -> LandedPayload:
    record = json.loads(path.read_text())
    record["fetched_at"] = datetime.fromisoformat(record["fetched_at"])
    return LandedPayload(**record)

