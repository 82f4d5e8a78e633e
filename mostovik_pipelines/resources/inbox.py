"""A folder that people drop files into (an inbox), and the archive files move to once loaded:
a directory, or a prefix of an S3-compatible object store (``s3://bucket/prefix``, the archive
likewise: :mod:`.inbox_objects`).

Only regular files directly inside the inbox are seen: no symlink (in or out), no folder, no
hidden or partial upload (``.name``, ``~$name``, ``*.part``, ``*.tmp``), no name that is not a
plain file name. A file version is its name plus the first characters of its content's sha256,
``<name>@<hash>`` (on object storage, of the object's ETag and size, which the listing gives),
so a corrected upload under the same name is a new version. Files are never deleted: a loaded
one moves to the archive as ``<name>@<hash>`` with a note of its outcome, a failed one stays in
the inbox for an operator to see.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from dagster import ConfigurableResource

from mostovik_pipelines.core.errors import (
    ConfigurationError,
    DataValidationError,
    PermanentError,
)
from mostovik_pipelines.resources.inbox_objects import ObjectStoreInbox, version_hash
from mostovik_pipelines.resources.stores import is_object_store

VERSION_SEPARATOR = "@"
HASH_CHARACTERS = 12
IGNORED_SUFFIXES = (".part", ".tmp", ".crdownload")
HASH_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class InboxFile:
    """A file seen in the inbox: its name and what tells a changed file from an unchanged one."""

    name: str
    size: int
    modified_ns: int
    etag: str = ""
    """The object's ETag, on object storage."""


def version_key(name: str, content_hash: str) -> str:
    """The partition key of a file version."""
    return f"{name}{VERSION_SEPARATOR}{content_hash[:HASH_CHARACTERS]}"


def file_name_of(version: str) -> str:
    """The file name a version key stands for."""
    return version.rsplit(VERSION_SEPARATOR, 1)[0]


class InboxResource(ConfigurableResource):
    """The inbox folder, its archive, and the size over which a file is refused."""

    inbox_dir: str
    archive_dir: str
    max_file_bytes: int = 50 * 1024 * 1024

    def files(self) -> Iterator[InboxFile]:
        """The files an inbox scan considers, cheaply (one directory read or one listing, no
        file opened)."""
        if self._objects() is not None:
            for name, size, modified_ns, etag in self._objects().listing():
                if _plain_name(name):
                    yield InboxFile(name, size, modified_ns, etag)
            return
        os.makedirs(self.inbox_dir, exist_ok=True)
        with os.scandir(self.inbox_dir) as entries:
            for entry in entries:
                if not _plain_name(entry.name) or entry.is_symlink():
                    continue
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(info.st_mode):
                    yield InboxFile(entry.name, info.st_size, info.st_mtime_ns)

    def version_hash(self, file: InboxFile) -> str:
        """What the version key of ``file`` is made of: its content's sha256 (the file read), or
        on object storage a hash of the ETag and size the listing gave (nothing read)."""
        if self._objects() is not None:
            return version_hash(file.etag, file.size)
        return self.content_hash(file.name)

    def content_hash(self, name: str) -> str:
        """The sha256 of an inbox file, read in chunks."""
        digest = hashlib.sha256()
        with self._open(name) as handle:
            while chunk := handle.read(HASH_CHUNK_BYTES):
                digest.update(chunk)
        return digest.hexdigest()

    def read_version(self, version: str) -> tuple[bytes, datetime]:
        """The bytes of a file version and when that version appeared, from the inbox or, once
        archived, from the archive; refused when over the size limit or no longer anywhere."""
        name = _checked_version(version)
        if self._objects() is not None:
            found = self._objects().read_version(name, version, self.max_file_bytes,
                                                 version_key)
            if found is None:
                raise PermanentError(
                    f"file version {version!r} is neither in the inbox (replaced by a newer "
                    "upload, or removed) nor in the archive")
            return found
        for path in (Path(self.inbox_dir) / name, Path(self.archive_dir) / version):
            try:
                info = path.lstat()
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(info.st_mode):
                continue
            if info.st_size > self.max_file_bytes:
                raise DataValidationError(
                    f"file {name!r} is {info.st_size} bytes, over the {self.max_file_bytes}-byte "
                    "limit: not read")
            content = _read_no_follow(path)
            if version_key(name, hashlib.sha256(content).hexdigest()) == version:
                return content, datetime.fromtimestamp(info.st_mtime, UTC)
        raise PermanentError(
            f"file version {version!r} is neither in the inbox (replaced by a newer upload, or "
            "removed) nor in the archive")

    def archive(self, version: str, outcome: str, run_id: str) -> None:
        """Move the version from the inbox to the archive with a note of its outcome. The file
        is first moved aside under a private name and hashed there, so an upload landing under
        the same name meanwhile is never archived in its place: it goes back to the inbox (or,
        if yet another upload took the name, to the archive under its own version)."""
        name = _checked_version(version)
        if self._objects() is not None:
            self._objects().archive(name, version, _note(name, version, outcome, run_id),
                                    version_key)
            return
        archive = Path(self.archive_dir)
        archive.mkdir(parents=True, exist_ok=True)
        aside = archive / f".archiving-{uuid.uuid4().hex}"
        try:
            os.rename(Path(self.inbox_dir) / name, aside)
        except FileNotFoundError:
            aside = None
        if aside is not None:
            moved = version_key(name, _sha256(aside))
            if moved == version:
                os.replace(aside, archive / version)
            else:
                try:
                    os.link(aside, Path(self.inbox_dir) / name)
                    aside.unlink()
                except FileExistsError:
                    os.replace(aside, archive / moved)
        if (archive / version).exists():
            (archive / f"{version}.outcome.json").write_text(json.dumps(
                _note(name, version, outcome, run_id), ensure_ascii=False, indent=1))

    def _objects(self) -> ObjectStoreInbox | None:
        """The inbox and archive on object storage, or None for directories."""
        on_store = is_object_store(self.inbox_dir), is_object_store(self.archive_dir)
        if not any(on_store):
            return None
        if not all(on_store):
            raise ConfigurationError(
                "the inbox and its archive must both be directories or both s3:// prefixes "
                f"(MOSTOVIK_INBOX_DIR={self.inbox_dir!r}, MOSTOVIK_ARCHIVE_DIR="
                f"{self.archive_dir!r})")
        return ObjectStoreInbox(self.inbox_dir, self.archive_dir)

    def _open(self, name: str):
        if not _plain_name(name):
            raise PermanentError(f"{name!r} is not a plain file name")
        fd = os.open(Path(self.inbox_dir) / name, os.O_RDONLY | os.O_NOFOLLOW)
        return os.fdopen(fd, "rb")


def _note(name: str, version: str, outcome: str, run_id: str) -> dict:
    """The archived version's note of its outcome."""
    return {"file": name, "version": version, "outcome": outcome, "run_id": run_id,
            "archived_at": datetime.now(UTC).isoformat()}


def _checked_version(version: str) -> str:
    """The file name of a version key that names a plain inbox file and a content hash, or a
    refusal: a version key never leads a path out of the inbox or the archive."""
    name = file_name_of(version)
    digest = version[len(name) + 1:]
    if not _plain_name(name) or len(digest) != HASH_CHARACTERS or not all(
            c in "0123456789abcdef" for c in digest):
        raise PermanentError(f"{version!r} is not a file version of this inbox "
                             "(<plain file name>@<12 hex digits>)")
    return name


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with _open_no_follow(path) as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _open_no_follow(path: Path):
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")


def _read_no_follow(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def _plain_name(name: str) -> bool:
    return (bool(name) and name == os.path.basename(name) and name not in (".", "..")
            and not name.startswith((".", "~$")) and not name.endswith(IGNORED_SUFFIXES)
            and "\x00" not in name)
