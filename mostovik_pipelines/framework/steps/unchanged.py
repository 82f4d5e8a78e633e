"""A re-load of the payload a partition's stored rows came from, by the same code: its rows are
not validated into a frame, hashed or compared again (the user's decision for a year already
loaded, where that was most of each partition's work).

The ledger (``partition_loads``) names, for every partition, the landed payload its last load
came from (its sha256), the code that parsed and validated it (:func:`parser_version`) and a
digest of the rows that load wrote, which the table's guard trigger forgets on any write
outside the loader (:mod:`..load.ledger`). When all three still hold for the payload a run just
landed, the table holds exactly the rows that code makes of that payload. Transform still
parses the payload (its shape is judged and a change of it fails or warns as always) but hands
the load a :class:`.outcomes.PayloadUnchanged` instead of a validated frame; the load confirms
the ledger's line under the partition's locks, checks the fence and commits
(:func:`..load.partition.confirm_unchanged`), and records the partition's materialisation and
its checks' results as for any load. A change of the code (any file of the package, or of the
libraries it parses with), a row written by hand (the digest forgotten) or another payload make
it a load like any other; so does anything the load finds changed under its locks.
PostgreSQL only (SQLite records no digest); whole-payload replace-partition sources only (a
sync's pages are merged by version).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from sqlalchemy import Engine

from mostovik_pipelines.core.load_target import LoadMode
from mostovik_pipelines.framework.assets.view import PREVIEW_ROWS, markdown_table
from mostovik_pipelines.framework.load.ledger import LedgerEntry, ledger_entries
from mostovik_pipelines.framework.quality.shape import ShapeReport
from mostovik_pipelines.framework.spec import ParsedRows, SourceSpec
from mostovik_pipelines.framework.steps.outcomes import PayloadUnchanged
from mostovik_pipelines.resources.landing import LandedPayload

PARSING_LIBRARIES = ("pandas", "pyarrow", "numpy")
LEDGER_BATCH = 1_000
"""Partitions whose ledger lines one query reads."""


@functools.cache
def _package_digest() -> str:
    """The sha256 of every Python file of the package (its path and its bytes) and of the
    versions of the libraries rows are made with: whatever part of the code reads a payload, a
    change of it changes this."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    for library in PARSING_LIBRARIES:
        digest.update(f"{library} {version(library)}\n".encode())
    return digest.hexdigest()


def parser_version(spec: SourceSpec) -> str:
    """What made a partition's rows of its payload: the package's code and libraries, the
    source's transform (a declaration given another transform has another parser) and what its
    declaration says about its rows."""
    target = spec.load_target
    transform = spec.transform
    code = getattr(transform, "__code__", None)
    parts = [
        _package_digest(), spec.name,
        f"{getattr(transform, '__module__', '')}.{getattr(transform, '__qualname__', '')}",
        hashlib.sha256(code.co_code).hexdigest() if code is not None else repr(transform),
        repr([(c.name, str(c.type), c.nullable) for c in target.table.columns]),
        repr((tuple(target.natural_key), target.partition_column, target.mode.value,
              target.empty_payload_is_valid, spec.max_rejected_share)),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


@dataclass(frozen=True)
class StoredPayloads:
    """What transform compares each landed payload with: the parser now, and the ledger's line
    of every partition of the run whose stored rows a digest still vouches for."""

    parser_version: str
    entries: dict[str, LedgerEntry]


def stored_payloads(engine: Engine, spec: SourceSpec,
                    partition_keys: Sequence[str]) -> StoredPayloads | None:
    """The ledger's lines of the run's partitions (a query per ``LEDGER_BATCH`` partitions);
    None where no partition of the source can be found unchanged (SQLite, a sync, a merge)."""
    if (engine.dialect.name != "postgresql" or spec.paged
            or spec.load_mode is not LoadMode.REPLACE_PARTITION):
        return None
    target = spec.load_target
    scopes = {target.partition_scope(key): key for key in partition_keys}
    names = list(scopes)
    found: dict[str, LedgerEntry] = {}
    with engine.connect() as connection:
        for start in range(0, len(names), LEDGER_BATCH):
            for entry in ledger_entries(connection, spec.table.name,
                                        names[start:start + LEDGER_BATCH]):
                key = scopes[entry.partition_key]
                if entry.content_digest is not None and entry.key == key:
                    found[key] = entry
        connection.rollback()
    return StoredPayloads(parser_version(spec), found)


def unchanged(spec: SourceSpec, key: str, landed: LandedPayload, parsed: ParsedRows,
              shape: ShapeReport | None, stored: StoredPayloads) -> PayloadUnchanged | None:
    """The partition's rows need not be made again: the ledger's line names this payload and
    this parser, with a digest of the stored rows. None: load it as any other."""
    entry = stored.entries.get(key)
    if (entry is None or entry.content_digest is None or entry.payload_hash != landed.content_hash
            or entry.parser_version != stored.parser_version):
        return None
    rows = parsed.frame
    if not set(spec.load_target.columns) <= set(rows):
        return None  # not what the parser gave when it was loaded: validation will say
    count = len(next(iter(rows.values()), ())) if isinstance(rows, Mapping) else len(rows)
    return PayloadUnchanged(landed, entry.content_digest, stored.parser_version, count,
                            len(parsed.rejected), _preview(spec, rows), shape)


def _preview(spec: SourceSpec, rows) -> str:
    """The first rows the parser read, in the table's column order (the preview a load of them
    shows, before validation typed them)."""
    columns = spec.load_target.columns
    if isinstance(rows, Mapping):
        head = list(zip(*(list(rows[c][:PREVIEW_ROWS]) for c in columns), strict=True))
    else:
        head = list(rows[columns].head(PREVIEW_ROWS).itertuples(index=False, name=None))
    return markdown_table(columns, head)
