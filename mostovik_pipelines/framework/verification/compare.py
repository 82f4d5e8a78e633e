"""What the table stores for a partition against what the source says, by natural key.

Read in one transaction that is rolled back, with plain ``SELECT`` statements: nothing is
written, no lock is taken that a load would wait for. Compared as the loader decides what to
write: every column but the load bookkeeping; a value equal as the table stores it (an exact
decimal ``92.50`` is ``92.5``) is equal. Per partition:

* **missing**: a key the source sends that the table does not hold;
* **extra**: a key the table holds under the partition that the source does not send (for a
  sync: a record the source now shows in another window, or never sent);
* **differing**: a key held with other values, named column by column, stored and source
  value (for a sync, a record held under another window shows its ``window_date`` too);
* **quarantined**: a row the source still sends that a load quarantines (unreadable, or its
  key held by another file). What the table keeps under such a key is what a load keeps, so it
  is not extra. Such a row already in the partition's quarantine is noted, not a difference;
  one the quarantine does not hold (the source broke a row since the load) is.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import pandas as pd
from sqlalchemy import Connection, Date, func, select, tuple_

from mostovik_pipelines.core.load_target import KeyHeldElsewhere, LoadTarget
from mostovik_pipelines.framework.quality.quarantine import quarantined_rows
from mostovik_pipelines.framework.quality.validation import row_text
from mostovik_pipelines.framework.spec import RejectedRow, SourceSpec

KEYS_PER_QUERY = 500
SHOWN = 20
"""Entries of each kind a verdict's text lists (its counts are always whole)."""
LISTED = 1_000
"""Entries of each kind a verdict keeps (``--json``, a check's metadata)."""


class Status(enum.StrEnum):
    MATCHES = "matches"
    DIFFERS = "differs"
    NOT_LOADED = "not loaded"
    """Nothing loaded, so no payload to compare with (``landed``)."""
    SUPERSEDED = "superseded"
    """A file version whose file the table holds from a later version: that one is verified."""
    UNVERIFIABLE = "could not verify"


AGREES = (Status.MATCHES, Status.SUPERSEDED)


@dataclass(frozen=True)
class Difference:
    key: dict[str, str]
    column: str
    stored: str | None
    source: str | None


@dataclass(frozen=True)
class Quarantined:
    row_number: int
    reason: str
    key: dict[str, str] | None
    in_quarantine: bool
    """The partition's quarantine holds it already (a load left it there)."""


@dataclass(frozen=True)
class PartitionVerdict:
    """One partition compared with what the source says."""

    source: str
    partition_key: str
    against: str
    status: Status
    payload: str = ""
    note: str = ""
    source_rows: int = 0
    stored_rows: int = 0
    missing: list[dict[str, str]] = field(default_factory=list)
    extra: list[dict[str, str]] = field(default_factory=list)
    differing: list[Difference] = field(default_factory=list)
    quarantined: list[Quarantined] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    """Whole counts of missing, extra, differing (rows) and quarantined."""

    @property
    def agrees(self) -> bool:
        return self.status in AGREES

    def fingerprint(self) -> str:
        """What the differences are, hashed: a difference said once is not said again."""
        body = json.dumps([self.status.value, self.missing, self.extra,
                           [asdict(d) for d in self.differing],
                           [asdict(q) for q in self.quarantined if not q.in_quarantine],
                           self.note if not self.agrees else ""], sort_keys=True, default=str)
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def summary(self) -> str:
        figures = ", ".join(f"{n} {name}" for name, n in self.counts.items() if n)
        return (f"{self.partition_key}: {self.status.value}"
                + (f" ({figures})" if figures else "")
                + (f"; {self.note}" if self.note else ""))

    def lines(self) -> list[str]:
        """The verdict as an operator reads it: a headline, then each difference."""
        out = [self.summary()]
        out += [f"  missing   {_shown(key)}" for key in self.missing[:SHOWN]]
        out += [f"  extra     {_shown(key)}" for key in self.extra[:SHOWN]]
        out += [f"  differs   {_shown(d.key)} {d.column}: stored {d.stored!r}, source "
                f"{d.source!r}" for d in self.differing[:SHOWN]]
        out += [f"  {'quarantined' if q.in_quarantine else 'rejected now'} row {q.row_number}"
                f"{' ' + _shown(q.key) if q.key else ''}: {q.reason}"
                for q in self.quarantined[:SHOWN]]
        hidden = sum(self.counts.values()) - (len(out) - 1)
        if hidden > 0:
            out.append(f"  ... and {hidden} more (--json lists up to {LISTED} of each)")
        return out

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        data["agrees"] = self.agrees
        return data


def compare_partition(connection: Connection, spec: SourceSpec, key: str,
                      frame: pd.DataFrame, rejected: Sequence[RejectedRow], *,
                      against: str, payload: str = "", note: str = "",
                      version_of: tuple[str, str] | None = None) -> PartitionVerdict:
    """Compare the partition's stored rows with ``frame`` (the rows a load would write) and
    ``rejected`` (those it would quarantine). ``version_of`` (stored key, source key): a file
    source whose inbox holds a newer version of the file than the one loaded; a column that
    only records which version a row came from is not named as differing."""
    target = spec.load_target
    columns = target.columns
    key_columns = list(target.natural_key)
    source = {_key(row, key_columns, target): row
              for row in _records(frame, columns, target)}
    stored = _stored_rows(connection, target, key, list(source))
    own_value = _normal(target.partition_value(key), target, target.partition_column)
    held_elsewhere = {
        token: row for token, row in stored.items()
        if target.key_held_elsewhere is KeyHeldElsewhere.REJECT
        and token in source and row[target.partition_column] != own_value}
    quarantine = _in_quarantine(connection, spec.name, key)
    quarantined = [Quarantined(r.row_number, r.reason, _shown_key(r.key, key_columns, target),
                               r.raw in quarantine) for r in rejected]
    quarantined += [
        Quarantined(0, f"key {_shown(_token_dict(token, key_columns))} is already held by "
                       f"{row[target.partition_column]}: not overwritten",
                    _token_dict(token, key_columns),
                    row_text(pd.Series(source[token])) in quarantine)
        for token, row in held_elsewhere.items()]
    kept = {_key(r.key, key_columns, target) for r in rejected if r.key is not None}
    missing = [token for token in source if token not in stored]
    extra = [token for token, row in stored.items()
             if token not in source and token not in kept
             and row[target.partition_column] == own_value]
    differing: list[Difference] = []
    differing_rows = 0
    for token, row in source.items():
        if token not in stored or token in held_elsewhere:
            continue
        changed = [Difference(_token_dict(token, key_columns), column,
                              _text(stored[token][column]), _text(row[column]))
                   for column in columns if column not in key_columns
                   and not _same(stored[token][column], row[column])
                   and not _version_column(version_of, stored[token][column], row[column])]
        differing_rows += bool(changed)
        differing += changed
    rejected_now = sum(not q.in_quarantine for q in quarantined)
    status = Status.DIFFERS if (missing or extra or differing or rejected_now) else (
        Status.MATCHES)
    return PartitionVerdict(
        source=spec.name, partition_key=key, against=against, status=status, payload=payload,
        note=note, source_rows=len(source),
        stored_rows=sum(row[target.partition_column] == own_value for row in stored.values()),
        missing=[_token_dict(t, key_columns) for t in missing[:LISTED]],
        extra=[_token_dict(t, key_columns) for t in extra[:LISTED]],
        differing=differing[:LISTED], quarantined=quarantined[:LISTED],
        counts={"missing": len(missing), "extra": len(extra), "differing": differing_rows,
                "quarantined": len(quarantined)})


def stored_row_count(connection: Connection, spec: SourceSpec, key: str) -> int:
    """How many rows the table holds under the partition."""
    target = spec.load_target
    return connection.execute(select(func.count()).select_from(target.table).where(
        target.table.c[target.partition_column] == target.partition_value(key))).scalar_one()


# --- reading ---------------------------------------------------------------------------------


def _stored_rows(connection: Connection, target: LoadTarget, key: str,
                 source_keys: list[tuple]) -> dict[tuple, dict[str, Any]]:
    """The partition's stored rows, and (a key that is not the partition's) the rows anywhere
    in the table under the keys the source sends: by normalised natural key."""
    table, columns = target.table, target.columns
    key_columns = list(target.natural_key)
    selected = select(*(table.c[c] for c in columns))
    rows = list(connection.execute(selected.where(
        table.c[target.partition_column] == target.partition_value(key))).mappings())
    if target.partition_column not in key_columns:
        keys = [table.c[c] for c in key_columns]
        for start in range(0, len(source_keys), KEYS_PER_QUERY):
            batch = source_keys[start:start + KEYS_PER_QUERY]
            condition = (keys[0].in_([t[0] for t in batch]) if len(keys) == 1
                         else tuple_(*keys).in_(batch))
            rows += connection.execute(selected.where(condition)).mappings()
    found: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        normal = {c: _normal(row[c], target, c) for c in columns}
        found[_key(normal, key_columns, target)] = normal
    return found


def _in_quarantine(connection: Connection, source: str, key: str) -> set[str]:
    return set(connection.execute(select(quarantined_rows.c.raw_row).where(
        quarantined_rows.c.source == source,
        quarantined_rows.c.partition_key == key)).scalars())


def _records(frame: pd.DataFrame, columns: Sequence[str],
             target: LoadTarget) -> Iterable[dict[str, Any]]:
    for values in frame[list(columns)].itertuples(index=False, name=None):
        yield {c: _normal(v, target, c) for c, v in zip(columns, values, strict=True)}


# --- values ----------------------------------------------------------------------------------


def _normal(value: Any, target: LoadTarget, column: str) -> Any:
    """A value as Python holds it, whatever read it (pandas, a driver): None for nothing, a
    date for a date column, plain ints and floats."""
    if value is None or value is pd.NaT:
        return None
    if hasattr(value, "item") and not isinstance(value, Decimal | str):
        value = value.item()  # numpy scalars
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, pd.Timestamp):
        value = value.to_pydatetime()
    if isinstance(target.table.c[column].type, Date) and isinstance(value, datetime):
        return value.date()
    return value


def _key(row: dict[str, Any] | None, key_columns: list[str], target: LoadTarget) -> tuple:
    assert row is not None
    return tuple(_token(_normal(row[c], target, c)) for c in key_columns)


def _token(value: Any) -> Any:
    """A key part as a comparable, hashable value (an exact decimal by value)."""
    return value.normalize() if isinstance(value, Decimal) else value


def _same(stored: Any, sent: Any) -> bool:
    if stored is None or sent is None:
        return stored is None and sent is None
    if isinstance(stored, datetime) and isinstance(sent, datetime):
        if (stored.tzinfo is None) != (sent.tzinfo is None):
            # SQLite keeps a time's wall clock without its zone.
            return stored.replace(tzinfo=None) == sent.replace(tzinfo=None)
        return stored == sent
    if isinstance(stored, Decimal) or isinstance(sent, Decimal):
        try:
            return Decimal(str(stored)) == Decimal(str(sent))
        except ArithmeticError:
            return False
    if isinstance(stored, date) and isinstance(sent, date):
        return stored == sent
    return stored == sent


def _version_column(version_of: tuple[str, str] | None, stored: Any, sent: Any) -> bool:
    return version_of is not None and (stored, sent) == version_of


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, date | datetime):
        return value.isoformat()
    return str(value)


def _token_dict(token: tuple, key_columns: list[str]) -> dict[str, str]:
    return {c: _text(v) or "" for c, v in zip(key_columns, token, strict=True)}


def _shown_key(key: dict | None, key_columns: list[str],
               target: LoadTarget) -> dict[str, str] | None:
    if key is None:
        return None
    return _token_dict(_key(key, key_columns, target), key_columns)


def _shown(key: dict[str, str] | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (key or {}).items())
