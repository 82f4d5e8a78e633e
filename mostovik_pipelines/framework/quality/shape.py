"""What a source sends, field by field, against what its declaration expects: a changed
source is noticed at once, said once, and its declaration's policy decides whether the
partition loads.

* A source's transform reports the shape of each payload it reads
  (``request.report_shape(...)``): the fields in the order the source sent them (JSON keys, XML
  elements and attributes, CSV/XLSX headers) and the kinds of their values (:class:`ValueKind`),
  read with :func:`observe_records`, :func:`observe_xml` or :func:`observe_columns`. Kinds are
  read from at most :data:`SAMPLE_VALUES` values per field, spread over the payload: a
  100,000-row report costs what a 1,000-row one does.
* The framework compares it with the declaration's :class:`SourceShape` (:func:`judge`):
  - an added field: policy ``warn`` loads as usual and the partition's check ``source_shape``
    warns naming it; ``freeze`` fails the partition as a contract error naming it;
  - a missing field (not declared optional) fails the partition as a contract error naming it
    and the field that looks like its replacement (same position, a similar name, or the same
    kind of values);
  - a field whose non-empty values are, for more than the declared ``systematic_share``, of a
    kind the declaration does not accept (a number now text with a unit, another date format)
    fails the whole partition as a contract error, instead of rejecting its rows one by one;
  - a payload without the records the declaration names (``SourceShape.records``) is an empty
    period only when it holds nothing else: one that holds other fields (the record element
    renamed) fails as a contract error, never loads as an empty period.
  Nothing here ever changes a table: accepting a change is an edit of the declaration.
* A partition whose shape differs from the declaration is recorded as an asset observation of
  the partition (:func:`observation_metadata`): the UI shows it, and the sensor
  ``source_shape_alerts`` (:mod:`..runs.alerts`) raises one alert per change, at the first
  partition that shows it. Every loaded partition's materialisation carries the shape sent.
"""

from __future__ import annotations

import difflib
import enum
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import Any
from xml.etree.ElementTree import Element

SAMPLE_VALUES = 1_000
"""Values per field whose kind is read, spread evenly over the payload."""
SAMPLE_RECORDS = 10
"""JSON records per payload whose values' kinds are read (every record's keys are): a sync
sends a window in hundreds of pages, each observed on its own and judged with those before."""
SIMILAR_NAME = 0.6
"""difflib's ratio from which two field names look alike (``Value`` and ``Values``)."""


class ValueKind(enum.StrEnum):
    """What a value looks like as the source sent it."""

    EMPTY = "empty"
    INTEGER = "integer"
    DECIMAL = "decimal"
    """A decimal point: ``1234.50``, or a number cell of a spreadsheet."""
    DECIMAL_COMMA = "decimal_comma"
    """A decimal comma: ``1234,50``, ``1 234,50``."""
    DATE_ISO = "date_iso"
    """``YYYY-MM-DD``, or a date cell of a spreadsheet."""
    DATE_DMY = "date_dmy"
    """``DD.MM.YYYY``."""
    DATETIME = "datetime"
    """An ISO-8601 instant, or a date-and-time cell."""
    BOOLEAN = "boolean"
    TEXT = "text"


NUMBER = frozenset({ValueKind.INTEGER, ValueKind.DECIMAL, ValueKind.DECIMAL_COMMA})
"""Every way a number is written."""

_SPACES = "[ \u00a0\u202f\u2009]"
_PATTERNS = (
    (re.compile(r"[+-]?\d+"), ValueKind.INTEGER),
    (re.compile(r"-?\d+\.\d+"), ValueKind.DECIMAL),
    (re.compile(r"-?\d+,\d+"), ValueKind.DECIMAL_COMMA),
    (re.compile(rf"-?\d{{1,3}}(?:{_SPACES}\d{{3}})+"), ValueKind.INTEGER),
    (re.compile(rf"-?\d{{1,3}}(?:{_SPACES}\d{{3}})+\.\d+"), ValueKind.DECIMAL),
    (re.compile(rf"-?\d{{1,3}}(?:{_SPACES}\d{{3}})+,\d+"), ValueKind.DECIMAL_COMMA),
    (re.compile(r"\d{4}-\d{2}-\d{2}"), ValueKind.DATE_ISO),
    (re.compile(r"\d{1,2}\.\d{1,2}\.\d{4}"), ValueKind.DATE_DMY),
    (re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}.*"), ValueKind.DATETIME),
    (re.compile(r"true|false", re.IGNORECASE), ValueKind.BOOLEAN),
)

_NUMBER_OR_BOOLEAN_STARTS = frozenset("0123456789+-tfTF")


def kind_of(value: Any) -> ValueKind:
    """The kind of one value as the source sent it (text, or a typed JSON or spreadsheet cell)."""
    if value is None:
        return ValueKind.EMPTY
    if isinstance(value, bool):
        return ValueKind.BOOLEAN
    if isinstance(value, int):
        return ValueKind.INTEGER
    if isinstance(value, float):
        return ValueKind.INTEGER if value.is_integer() else ValueKind.DECIMAL
    if isinstance(value, Decimal):
        return ValueKind.DECIMAL
    if isinstance(value, datetime):
        return ValueKind.DATETIME
    if isinstance(value, date):
        return ValueKind.DATE_ISO
    if not isinstance(value, str):
        return ValueKind.TEXT
    text = value.strip()
    if not text:
        return ValueKind.EMPTY
    if text[0] not in _NUMBER_OR_BOOLEAN_STARTS:
        return ValueKind.TEXT  # most text is told at its first character
    for pattern, kind in _PATTERNS:
        if pattern.fullmatch(text):
            return kind
    return ValueKind.TEXT


# --- what the source sent -----------------------------------------------------------------------


@dataclass(frozen=True)
class ObservedField:
    """One field the source sent: its name and how many of the sampled values were of each
    kind."""

    name: str
    kinds: Mapping[str, int]

    def shown(self) -> str:
        kinds = [kind for kind in self.kinds if kind != ValueKind.EMPTY] or list(self.kinds)
        return f"{self.name} ({', '.join(sorted(kinds)) or 'no value'})"


@dataclass(frozen=True)
class ObservedShape:
    """The fields of one payload, in the order the source sent them."""

    fields: tuple[ObservedField, ...]
    records: int | None = None
    """How many records the payload holds (XML record elements, JSON records, data rows);
    None when not counted. A payload without any is an empty period only when it holds
    nothing else (:attr:`SourceShape.records`)."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def merged(self, other: ObservedShape) -> ObservedShape:
        """The shape of two payloads of a partition (its pages): every field, kinds summed."""
        kinds: dict[str, dict[str, int]] = {f.name: dict(f.kinds) for f in self.fields}
        for f in other.fields:
            counts = kinds.setdefault(f.name, {})
            for kind, n in f.kinds.items():
                counts[kind] = counts.get(kind, 0) + n
        records = (None if self.records is None or other.records is None
                   else self.records + other.records)
        return ObservedShape(tuple(ObservedField(name, counts) for name, counts in kinds.items()),
                             records)


def _sample(values: Sequence[Any]) -> Sequence[Any]:
    if len(values) <= SAMPLE_VALUES:
        return values
    step = len(values) / SAMPLE_VALUES
    return [values[int(i * step)] for i in range(SAMPLE_VALUES)]


def _counted(values: Iterable[Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        kind = kind_of(value).value
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def observe_columns(names: Sequence[str], columns: Sequence[Sequence[Any]]) -> ObservedShape:
    """A table's shape (CSV or XLSX): its header names and each column's values."""
    return ObservedShape(tuple(ObservedField(str(name), _counted(_sample(values)))
                               for name, values in zip(names, columns, strict=True)),
                         records=max((len(values) for values in columns), default=0))


def observe_records(records: Sequence[Any]) -> ObservedShape:
    """The shape of JSON records (objects): every key any record has, in first-seen order."""
    names: dict[str, None] = {}
    for record in records:
        if isinstance(record, dict):
            names.update(dict.fromkeys(record))
    step = max(len(records) / SAMPLE_RECORDS, 1)
    sample = [r for r in (records[int(i * step)] for i in range(min(len(records),
                                                                   SAMPLE_RECORDS)))
              if isinstance(r, dict)]
    return ObservedShape(tuple(ObservedField(name, _counted(r.get(name) for r in sample
                                                            if name in r))
                               for name in names), records=len(records))


def observe_xml(root: Element, record: str) -> ObservedShape:
    """An XML document's shape: the root's attributes (``Root/@name``), and the attributes and
    child elements of its ``record`` elements (``Record/@name``, ``Record/Child``)."""
    values: dict[str, list[Any]] = {f"{root.tag}/@{name}": [value]
                                    for name, value in root.attrib.items()}
    elements = root.findall(record)
    for element in _sample(elements):
        for name, value in element.attrib.items():
            values.setdefault(f"{record}/@{name}", []).append(value)
        for child in element:
            values.setdefault(f"{record}/{child.tag}", []).append(child.text)
    for child in root:
        if child.tag != record:
            values.setdefault(f"{root.tag}/{child.tag}", []).append(child.text)
    return ObservedShape(tuple(ObservedField(name, _counted(v)) for name, v in values.items()),
                         records=len(elements))


# --- what the source declares -------------------------------------------------------------------


class AddedFieldPolicy(enum.StrEnum):
    """What a partition does when the source sends a field its declaration does not expect."""

    WARN = "warn"
    """Load as usual; the partition's check ``source_shape`` warns, naming the field."""
    FREEZE = "freeze"
    """Fail the partition as a contract error naming the field, until the declaration
    accepts it."""


@dataclass(frozen=True)
class ExpectedField:
    name: str
    kinds: frozenset[ValueKind]
    """The kinds its non-empty values may have."""
    optional: bool = False
    """The source may leave the field out (a field it added later, absent from old periods)."""


def expect(name: str, *kinds: ValueKind | frozenset[ValueKind],
           optional: bool = False) -> ExpectedField:
    """A field the source sends, with the kinds its values may have."""
    accepted: set[ValueKind] = set()
    for kind in kinds:
        accepted |= kind if isinstance(kind, frozenset) else {kind}
    return ExpectedField(name, frozenset(accepted), optional)


@dataclass(frozen=True)
class SourceShape:
    """The fields a source sends, in the order it sends them: part of its declaration."""

    fields: tuple[ExpectedField, ...]
    on_added: AddedFieldPolicy | None = None
    """None: the default of the source's kind (:data:`.spec.DEFAULT_ON_ADDED`)."""
    systematic_share: float = 0.5
    """The share of a field's non-empty values of a kind not accepted above which the field
    changed kind (a contract error for the partition); below it, the rows are the parser's to
    reject one by one."""
    records: str | None = None
    """What a record is called in the payload (an XML element: its fields are declared as
    ``Record/...``). A payload without records is an empty period only when it says so
    positively, holding nothing it does not declare; one that holds something else (the
    record element renamed) is a change of shape, never an empty period. Required of a source
    whose empty payload is valid."""

    def is_record_field(self, name: str) -> bool:
        """Whether a payload sends ``name`` inside its records (``Record/...``; every field
        of a source whose fields are not named by their record), not around them."""
        prefixed = any(f.name.startswith(f"{self.records}/") for f in self.fields)
        return bool(self.records) and (name.startswith(f"{self.records}/") or not prefixed)

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"a field is declared twice in {names}")
        if not 0.0 <= self.systematic_share < 1.0:
            raise ValueError("systematic_share must be in [0, 1)")


# --- the comparison ----------------------------------------------------------------------------


@dataclass(frozen=True)
class KindChange:
    name: str
    expected: tuple[str, ...]
    sent: Mapping[str, int]
    """Non-empty values sampled, by kind."""

    def shown(self) -> str:
        other = {k: n for k, n in self.sent.items() if k not in self.expected}
        total = sum(self.sent.values())
        return (f"{self.name} is now {', '.join(sorted(other))} ({sum(other.values())} of "
                f"{total} values), expected {' or '.join(self.expected)}")


@dataclass(frozen=True)
class ShapeDrift:
    """How a payload's shape differs from the declaration."""

    added: tuple[str, ...] = ()
    """Fields sent that the declaration does not expect (replacements of missing ones too)."""
    missing: tuple[str, ...] = ()
    replacements: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """Missing field -> (the sent field that looks like its replacement, why)."""
    kinds: tuple[KindChange, ...] = ()
    no_records: str | None = None
    """The records the declaration expects, when the payload holds none of them but other
    fields (``added``): not an empty period."""

    def __bool__(self) -> bool:
        return bool(self.added or self.missing or self.kinds or self.no_records)

    def breaks(self, policy: AddedFieldPolicy) -> bool:
        """Whether the partition fails under the declaration's policy for added fields."""
        return bool(self.missing or self.kinds or self.no_records
                    or (self.added and policy is AddedFieldPolicy.FREEZE))

    @property
    def fingerprint(self) -> str:
        """The same change gives the same text, whatever the partition: what is said once."""
        parts: list = [sorted(self.added), sorted(self.missing),
                       sorted((c.name, sorted(c.sent)) for c in self.kinds)]
        if self.no_records:
            parts.append(self.no_records)
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    def describe(self) -> str:
        replacing = {new for new, _ in self.replacements.values()}
        parts = ([f"no {self.no_records} records but {', '.join(self.added)}: not an empty "
                  "period"] if self.no_records else [])
        parts += [f"added field {name}" for name in self.added
                  if name not in replacing and not self.no_records]
        for name in self.missing:
            if name in self.replacements:
                new, why = self.replacements[name]
                parts.append(f"missing field {name}, {new} looks like its replacement ({why})")
            else:
                parts.append(f"missing field {name}")
        parts += [change.shown() for change in self.kinds]
        return "; ".join(parts) or "no change"


def compare(shape: SourceShape, observed: ObservedShape) -> ShapeDrift:
    """How ``observed`` differs from the declared ``shape``."""
    declared = {f.name: f for f in shape.fields}
    sent = {f.name: f for f in observed.fields}
    added = tuple(name for name in observed.names if name not in declared)
    without_records = bool(shape.records) and observed.records == 0
    missing = tuple(f.name for f in shape.fields if f.name not in sent and not f.optional
                    and not (without_records and shape.is_record_field(f.name)))
    if without_records and added:
        return ShapeDrift(added, missing, no_records=shape.records)
    replacements = {name: found for name in missing
                    if (found := _replacement(name, shape, observed, added))}
    kinds = []
    for name, expected in declared.items():
        if name not in sent:
            continue
        values = {k: n for k, n in sent[name].kinds.items() if k != ValueKind.EMPTY}
        total = sum(values.values())
        other = sum(n for k, n in values.items() if k not in expected.kinds)
        if total and other / total > shape.systematic_share:
            kinds.append(KindChange(name, tuple(sorted(expected.kinds)), values))
    return ShapeDrift(added, missing, replacements, tuple(kinds))


def _replacement(name: str, shape: SourceShape, observed: ObservedShape,
                 added: tuple[str, ...]) -> tuple[str, str] | None:
    """The added field that looks like the missing ``name``'s replacement, and why."""
    position = [f.name for f in shape.fields].index(name)
    expected = next(f for f in shape.fields if f.name == name)
    best: tuple[int, str, str] | None = None
    for candidate in added:
        reasons = []
        if observed.names.index(candidate) == position:
            reasons.append("same position")
        if difflib.SequenceMatcher(None, name.lower(), candidate.lower()).ratio() >= (
                SIMILAR_NAME):
            reasons.append("similar name")
        kinds = {k for k in observed.fields[observed.names.index(candidate)].kinds
                 if k != ValueKind.EMPTY}
        if kinds and kinds <= expected.kinds:
            reasons.append("same kind of values")
        if reasons and (reasons != ["same kind of values"] or len(added) == 1) and (
                best is None or len(reasons) > best[0]):
            best = (len(reasons), candidate, ", ".join(reasons))
    return (best[1], best[2]) if best else None


@dataclass(frozen=True)
class ShapeReport:
    """A partition's shape as sent, how it differs from the declaration, and the policy."""

    source: str
    observed: ObservedShape
    drift: ShapeDrift
    policy: AddedFieldPolicy

    @property
    def breaks(self) -> bool:
        return self.drift.breaks(self.policy)

    def message(self, declaration: str) -> str:
        """The contract error's text: what changed, and how to accept it."""
        return (f"the source changed what it sends: {self.drift.describe()}; nothing is "
                f"loaded until {declaration} declares the fields it sends now")


def judge(source: str, shape: SourceShape, policy: AddedFieldPolicy,
          observed: Sequence[ObservedShape]) -> ShapeReport | None:
    """The partition's shape (its payloads' shapes merged) against the declaration; None when
    the transform reported none (it failed before reading any field)."""
    if not observed:
        return None
    merged = observed[0]
    for more in observed[1:]:
        merged = merged.merged(more)
    return ShapeReport(source, merged, compare(shape, merged), policy)


# --- what the UI shows --------------------------------------------------------------------------

SHAPE_KEY = "source_shape"
"""Metadata: the fields the source sent for the partition, with their kinds."""
CHANGE_KEY = "source_shape_change"
"""Metadata of an observation: what differs from the declaration."""
FINGERPRINT_KEY = "source_shape_fingerprint"
"""Metadata of an observation: the change's fingerprint, what an alert is said once for."""
OUTCOME_KEY = "source_shape_outcome"
"""Metadata of an observation: ``loaded`` (warned) or ``failed``."""


def shape_metadata(report: ShapeReport) -> dict[str, str]:
    """What a partition's materialisation shows of the shape sent."""
    return {SHAPE_KEY: ", ".join(f.shown() for f in report.observed.fields)}


def observation_metadata(report: ShapeReport) -> dict[str, str]:
    """What a partition whose shape drifted records (an asset observation of the partition)."""
    return {**shape_metadata(report), CHANGE_KEY: report.drift.describe(),
            FINGERPRINT_KEY: report.drift.fingerprint,
            OUTCOME_KEY: "failed" if report.breaks else "loaded"}
