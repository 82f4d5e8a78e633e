"""The inbox and its archive as prefixes of an S3-compatible object store (``s3://bucket/prefix``),
for back offices that upload their reports through the S3 API: no shared directory, no mount.

What the store guarantees, and what this builds on it:

* **An object appears whole or not at all.** A single upload is visible once it completed, a
  multipart upload once it was completed: an upload in progress is not listed, so it is never
  read half-written.
* **A version is the object's ETag plus its size**, both given by the listing: the partition key
  is ``<name>@<first 12 hex of sha256("<etag>:<size>")>``. The same bytes uploaded again the same
  way have the same ETag (a single upload's is the MD5 of its bytes), so they are the same version
  and not processed again; a corrected upload under the same name is a new version. (A multipart
  upload's ETag depends on its part size too: the same bytes uploaded in other parts are a new
  version, processed once more, which the load makes a no-op.)
* **Reads are of that version only.** An object is read with ``If-Match: <etag>``: if a newer
  upload replaced it since it was listed, the read is refused (``412``) instead of returning
  other bytes, and the version is looked for in the archive.
* **The archive is copy-then-delete, never a loss.** The version is copied to
  ``<archive>/<version>`` only if the inbox still holds it (``x-amz-copy-source-if-match``),
  with when it was uploaded kept in the copy's metadata; then the note of its outcome is written;
  last the inbox's object is deleted only if it is still that version (``If-Match`` on the
  delete, or its version id on a versioned bucket), so an upload landing under the same name
  meanwhile stays in the inbox. Interrupted after the copy, the version is in both places: nothing
  is lost, the sensor sees the same version and asks for nothing new, and the next archive of it
  finishes the move.
* **The sensor lists cheaply**: one listing of the prefix per tick (a request per thousand
  objects), no object opened.

Credentials and endpoint come from the environment only, as for the other stores
(:mod:`.stores`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from datetime import UTC, datetime

from fsspec.asyn import sync

from mostovik_pipelines.core.errors import DataValidationError
from mostovik_pipelines.resources.stores import store_path

UPLOADED_AT_KEY = "uploaded-at"
"""The archived copy's metadata: when the version was uploaded to the inbox (an ISO time)."""


def version_hash(etag: str, size: int) -> str:
    """The hash a version key is made of, from what the listing gives of an object."""
    return hashlib.sha256(f"{etag.strip(chr(34))}:{size}".encode()).hexdigest()


class ObjectStoreInbox:
    """The inbox at ``inbox_url`` and the archive at ``archive_url`` (both ``s3://``)."""

    def __init__(self, inbox_url: str, archive_url: str) -> None:
        self._inbox = store_path(inbox_url)
        self._archive = store_path(archive_url)
        self.fs = self._inbox.fs

    def listing(self) -> Iterator[tuple[str, int, int, str]]:
        """(name, size, modified_ns, etag) of every object directly under the inbox prefix, from
        one listing."""
        try:
            entries = self.fs.ls(self._inbox.path, detail=True, refresh=True)
        except FileNotFoundError:
            entries = []  # an empty prefix; a missing bucket is refused below
            if not self.fs.exists(self._inbox.path.split("/", 1)[0]):
                raise
        for entry in entries:
            if entry.get("type") != "file":
                continue
            name = entry["name"].rsplit("/", 1)[-1]
            modified = entry.get("LastModified")
            modified_ns = int(modified.timestamp() * 1e9) if modified else 0
            yield name, int(entry["size"]), modified_ns, entry.get("ETag", "")

    def read_version(self, name: str, version: str, max_file_bytes: int,
                     version_of) -> tuple[bytes, datetime] | None:
        """The bytes of ``version`` (of file ``name``) and when it was uploaded, from the inbox
        while it holds that version, else from the archive; None if neither has it."""
        key = f"{self._inbox.path}/{name}"
        head = self._head(key)
        if head is not None and version_of(name, version_hash(head["ETag"], head["size"])) \
                == version:
            _check_size(name, head["size"], max_file_bytes)
            content = self._get(key, head["ETag"])
            if content is not None:
                return content, head["LastModified"]
        archived = f"{self._archive.path}/{version}"
        head = self._head(archived)
        if head is None:
            return None
        _check_size(name, head["size"], max_file_bytes)
        content = self._get(archived, head["ETag"])
        if content is None:
            return None
        uploaded = head.get("Metadata", {}).get(UPLOADED_AT_KEY)
        return content, datetime.fromisoformat(uploaded) if uploaded else head["LastModified"]

    def archive(self, name: str, version: str, note: dict, version_of) -> None:
        """Copy the version to the archive if the inbox still holds it, write its note, then
        delete it from the inbox if it is still that version (see the module)."""
        key = f"{self._inbox.path}/{name}"
        bucket, object_key = key.split("/", 1)
        archive_bucket, archive_key = f"{self._archive.path}/{version}".split("/", 1)
        head = self._head(key)
        held = head is not None and version_of(
            name, version_hash(head["ETag"], head["size"])) == version
        if held:
            source = {"Bucket": bucket, "Key": object_key}
            if head.get("VersionId"):
                source["VersionId"] = head["VersionId"]
            if _precondition_failed(lambda: self.fs.call_s3(
                    "copy_object", Bucket=archive_bucket, Key=archive_key, CopySource=source,
                    CopySourceIfMatch=head["ETag"], MetadataDirective="REPLACE",
                    Metadata={UPLOADED_AT_KEY: head["LastModified"].isoformat()})):
                held = False  # replaced since the look: the newer upload is another version
        if self._head(f"{archive_bucket}/{archive_key}") is None:
            return
        self.fs.call_s3("put_object", Bucket=archive_bucket, Key=f"{archive_key}.outcome.json",
                        Body=json.dumps(note, ensure_ascii=False, indent=1).encode())
        if held:
            condition = ({"VersionId": head["VersionId"]} if head.get("VersionId")
                         else {"IfMatch": head["ETag"]})
            _precondition_failed(lambda: self.fs.call_s3(
                "delete_object", Bucket=bucket, Key=object_key, **condition))

    def _head(self, key: str) -> dict | None:
        bucket, object_key = key.split("/", 1)
        try:
            answer = self.fs.call_s3("head_object", Bucket=bucket, Key=object_key)
        except FileNotFoundError:
            return None
        except Exception as error:
            if _code(error) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return {"ETag": answer["ETag"], "size": answer["ContentLength"],
                "LastModified": answer["LastModified"].astimezone(UTC),
                "VersionId": answer.get("VersionId"), "Metadata": answer.get("Metadata", {})}

    def _get(self, key: str, etag: str) -> bytes | None:
        """The object's bytes if it is still ``etag``'s, else None."""
        bucket, object_key = key.split("/", 1)
        read: list[tuple[bytes, int]] = []

        async def get() -> None:
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=object_key,
                                              IfMatch=etag)
            async with response["Body"] as body:
                read.append((await body.read(), response["ContentLength"]))

        try:
            if _precondition_failed(lambda: sync(self.fs.loop, get)):
                return None
        except FileNotFoundError:
            return None
        content, length = read[0]
        if len(content) != length:  # a body cut short is never taken for the object
            raise ConnectionError(f"s3://{key}: {len(content)} of {length} bytes read")
        return content


def _precondition_failed(call) -> bool:
    """Make ``call``; True if the store refused it for a condition (``412``)."""
    try:
        call()
    except Exception as error:
        if _code(error) in ("412", "PreconditionFailed"):
            return True
        raise
    return False


def _code(error: BaseException) -> str:
    for candidate in (error, error.__cause__):
        response = getattr(candidate, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code", ""))
    return ""


def _check_size(name: str, size: int, limit: int) -> None:
    if size > limit:
        raise DataValidationError(
            f"file {name!r} is {size} bytes, over the {limit}-byte limit: not read")
