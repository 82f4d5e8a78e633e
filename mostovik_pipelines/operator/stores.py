"""``mostovik stores check [--create]``: every store the deployment reads and writes, reached and
written once with this process's settings, before the first run needs it.

The stores are the landing store (``MOSTOVIK_LANDING_DIR``), the op outputs
(``MOSTOVIK_STORAGE_DIR``) and each file source's inbox and archive (``MOSTOVIK_INBOX_DIR``,
``MOSTOVIK_ARCHIVE_DIR``): a directory, or a prefix of an S3-compatible bucket. Each is checked by
writing a probe (a hidden name, which the inbox sensor never sees), reading it back and removing
it. With ``--create`` a missing directory or bucket is created first (a bucket with the store's
defaults: no versioning needed, no lifecycle rule; deploy/README.md, "Object storage"), so the
runbook's install step needs no other tool than this package.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from mostovik_pipelines.core.settings import (
    LANDING_DIR_ENV,
    STORAGE_DIR_ENV,
    landing_dir,
    storage_dir,
)
from mostovik_pipelines.resources.inbox import InboxResource
from mostovik_pipelines.resources.stores import is_object_store, store_path, write_whole
from mostovik_pipelines.sources import ALL_SOURCES

PROBE = b"mostovik stores check"


@dataclass(frozen=True)
class Store:
    name: str
    setting: str
    location: str


def configured_stores() -> list[Store]:
    """The stores the code location uses, as this process's environment configures them."""
    stores = [Store("landing", LANDING_DIR_ENV, landing_dir()),
              Store("op outputs", STORAGE_DIR_ENV, storage_dir())]
    for spec in ALL_SOURCES:
        if isinstance(spec.resource, InboxResource):
            stores += [Store(f"{spec.name} inbox", "MOSTOVIK_INBOX_DIR", spec.resource.inbox_dir),
                       Store(f"{spec.name} archive", "MOSTOVIK_ARCHIVE_DIR",
                             spec.resource.archive_dir)]
    return stores


def check_store(store: Store, create: bool) -> str:
    """Write, read back and remove a probe in ``store``; what was created on the way. Raises
    with the store's setting named when the store cannot be reached or written."""
    created = ""
    if is_object_store(store.location):
        root = store_path(store.location)
        bucket = root.path.split("/", 1)[0]
        if not root.fs.exists(bucket):
            if not create:
                raise FileNotFoundError(f"no bucket {bucket!r} ({store.setting}="
                                        f"{store.location}): create it, or run with --create")
            root.fs.mkdir(bucket)
            created = f"created bucket {bucket}"
    else:
        root = Path(store.location)
        if not root.is_dir():
            if not create:
                raise FileNotFoundError(f"no directory {root} ({store.setting}): create it, "
                                        "or run with --create")
            root.mkdir(parents=True)
            created = f"created {root}"
    probe = root / f".mostovik-check-{secrets.token_hex(6)}"
    write_whole(probe, PROBE, durable=False)
    try:
        if probe.read_bytes() != PROBE:
            raise OSError(f"{probe}: read back other bytes than written ({store.setting})")
    finally:
        probe.unlink()
    return created
