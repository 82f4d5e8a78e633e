"""The ERP's work orders: one version of a record, the seeded days they are generated from (a
Moscow day at a time, in one vectorised draw from the seed and the day), and the changes the ERP
accepts to a record, refused as the real one refuses them. :mod:`.standin` describes the contract
they model."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np

from mostovik_pipelines.sources.erp_work_orders.standin_replies import ErpError, json_text

DEFAULT_SEED = 1
MAX_DAY_RECORDS = 999_999  # ids number a day's records in six digits
MAX_VERSION = 2**63 - 1  # the ERP keeps versions in a bigint
# The seeded history; days outside it have records only if a test sets their volume.
FIRST_DAY = date(2020, 1, 1)
LAST_DAY = date(2030, 12, 31)

STATUSES = ("planned", "in_progress", "done", "cancelled")
STATUS_WEIGHTS = (0.3, 0.4, 0.25, 0.05)
OBJECTS = ("BR-003", "BR-014", "BR-027", "BR-031", "TN-002", "OV-112", "OV-118", "RD-005",
           "PS-040")
WORKS = (
    "Бетонирование ростверка опоры №{n}",
    "Монтаж пролётного строения №{n}",
    "Устройство опалубки пролёта {n}",
    "Гидроизоляция плиты проезжей части, участок {n}",
    "Установка деформационного шва №{n}",
    "Антикоррозийная обработка металлоконструкций, секция {n}",
    "Укладка асфальтобетона, захватка {n}",
    "Устройство барьерного ограждения, пикет {n}",
    "Инструментальное обследование опоры №{n}",
    "Погружение свай, куст {n}",
)
_US = 1_000_000
_DAY_US = 86_400 * _US
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_ORDINAL = _EPOCH.date().toordinal()
_MSK_US = 3 * 3600 * _US  # Moscow has kept +03:00 all year since 2014
# Times of day (µs after Moscow midnight) at which the nightly imports stamp their records.
_BATCH_TIMES = np.array([2 * 3600 * _US, 2 * 3600 * _US + 500_000, 23 * 3600 * _US + 1800 * _US])
_BATCH_SHARE = 0.15
_WORKDAY_US = (8 * 3600 * _US, 20 * 3600 * _US)
_BASE_ID = re.compile(r"WO-(\d{8})-(\d{6})")
_KOPECK = Decimal("0.01")
_TITLES_JSON = tuple(tuple(json.dumps(work.format(n=n), ensure_ascii=False) for n in range(40))
                     for work in WORKS)
_CHANGE_FIELDS = {"object_code", "title", "status", "planned_start", "planned_finish", "amount"}


@dataclass
class WorkOrder:
    """One version of a work order."""

    id: str
    object_code: str
    title: str
    status: str
    planned_start: date | None
    planned_finish: date | None
    amount: str
    updated_at: datetime
    version: int
    deleted: bool
    us: int = dataclasses.field(init=False, repr=False)
    """``updated_at`` as microseconds since the epoch: the instant that orders records."""

    def __post_init__(self) -> None:
        self.us = epoch_us(self.updated_at)

    @classmethod
    def from_item(cls, item: dict[str, Any]) -> WorkOrder:
        return cls(
            id=item["id"],
            object_code=item["object_code"],
            title=item["title"],
            status=item["status"],
            planned_start=parse_date(item["planned_start"], "planned_start", nullable=True),
            planned_finish=parse_date(item["planned_finish"], "planned_finish", nullable=True),
            amount=item["amount"],
            updated_at=datetime.fromisoformat(item["updated_at"]),
            version=item["version"],
            deleted=item["deleted"],
        )

    def item(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object_code": self.object_code,
            "title": self.title,
            "status": self.status,
            "planned_start": _iso_date(self.planned_start),
            "planned_finish": _iso_date(self.planned_finish),
            "amount": self.amount,
            "updated_at": self.updated_at.isoformat(timespec="microseconds"),
            "version": self.version,
            "deleted": self.deleted,
        }

    def fragment(self) -> str:
        """The item as JSON text, the way pages are assembled."""
        return json_text(self.item())


@dataclass
class SeededDay:
    """A day's seeded records, by number within the day (the id's last six digits)."""

    day: date
    us: np.ndarray
    obj: np.ndarray
    work: np.ndarray
    work_n: np.ndarray
    status: np.ndarray
    start: np.ndarray  # date ordinal, 0 for none
    finish: np.ndarray
    kopecks: np.ndarray
    deleted: np.ndarray

    def __post_init__(self) -> None:
        self.id_prefix = f"WO-{self.day:%Y%m%d}-"

    def id_of(self, number: int) -> str:
        return f"{self.id_prefix}{number:06d}"

    def fragments(self, numbers: np.ndarray) -> list[str]:
        """These records as the JSON text of API items, written from whole columns at once with
        no encoder: the page of a 100,000-record day must cost microseconds per item. Every
        value is a number, a date, a fixed code or a pre-encoded title, so nothing needs
        escaping; ``WorkOrder.from_item`` parses them back the standard way."""
        us = self.us[numbers]
        moscow = np.datetime_as_string((us + _MSK_US).astype("datetime64[us]"), unit="us")
        return [
            f'{{"id":"{self.id_prefix}{number:06d}","object_code":"{OBJECTS[obj]}",'
            f'"title":{_TITLES_JSON[work][work_n]},"status":"{STATUSES[status]}",'
            f'"planned_start":{_date_json(start)},"planned_finish":{_date_json(finish)},'
            f'"amount":"{kopecks // 100}.{kopecks % 100:02d}",'
            f'"updated_at":"{local}+03:00","version":{at},'
            f'"deleted":{"true" if deleted else "false"}}}'
            for number, at, local, obj, work, work_n, status, start, finish, kopecks, deleted
            in zip(numbers.tolist(), us.tolist(), moscow.tolist(),
                   *(column[numbers].tolist() for column in (
                       self.obj, self.work, self.work_n, self.status, self.start, self.finish,
                       self.kopecks, self.deleted)), strict=True)
        ]

    def record(self, number: int) -> WorkOrder:
        return WorkOrder.from_item(json.loads(self.fragments(np.array([number]))[0]))


def generate(seed: int, day: date, n: int) -> SeededDay:
    rng = np.random.default_rng([seed, day.toordinal(), 1])
    in_batch = rng.random(n) < _BATCH_SHARE
    batch_time = _BATCH_TIMES[rng.integers(0, len(_BATCH_TIMES), n)]
    work_time = rng.integers(*_WORKDAY_US, n)
    start = day.toordinal() + rng.integers(-60, 60, n, endpoint=True)
    finish = start + rng.integers(1, 120, n, endpoint=True)
    undated = rng.random(n)
    # Roubles from 10 thousand to 50 million, log-uniform like real estimates.
    roubles = np.exp(rng.uniform(np.log(1e4), np.log(5e7), n))
    return SeededDay(
        day=day,
        us=_day_start_us(day) + np.where(in_batch, batch_time, work_time),
        obj=rng.integers(0, len(OBJECTS), n, dtype=np.uint8),
        work=rng.integers(0, len(WORKS), n, dtype=np.uint8),
        work_n=rng.integers(1, 40, n, dtype=np.uint8),
        status=rng.choice(len(STATUSES), n, p=STATUS_WEIGHTS).astype(np.uint8),
        start=np.where(undated < 0.06, 0, start),  # 6% not scheduled yet
        finish=np.where(undated < 0.10, 0, finish),  # 4% more with an open end
        kopecks=np.round(roubles * 100).astype(np.int64),
        deleted=rng.random(n) < 0.01,
    )


def changed(current: WorkOrder, change: dict[str, Any]) -> WorkOrder:
    """The record after one change; refuses what the real ERP cannot do."""
    op = change.get("op", "update")
    unknown = set(change) - {"op", "id", "updated_at", "version"} - _CHANGE_FIELDS
    if op not in ("update", "delete", "restore") or unknown or (
            op == "delete" and _CHANGE_FIELDS & set(change)):
        raise ErpError(400, "bad_change", f"unknown op or fields in {change!r}")
    if current.deleted != (op == "restore"):
        state = "deleted" if current.deleted else "not deleted"
        raise ErpError(409, "conflict", f"{current.id} is {state}: cannot {op} it")
    updated_at = parse_instant(change.get("updated_at"), "updated_at")
    if updated_at <= current.updated_at:
        raise ErpError(409, "conflict", f"{current.id}: updated_at must be later than "
                                        f"{current.updated_at.isoformat()}")
    version = change.get("version", max(current.version + 1, epoch_us(updated_at)))
    if not isinstance(version, int) or not current.version < version <= MAX_VERSION:
        raise ErpError(409, "conflict", f"{current.id}: version must grow from "
                                        f"{current.version} and fit a bigint")
    fields: dict[str, Any] = {name: change[name] for name in _CHANGE_FIELDS & set(change)}
    if "status" in fields and fields["status"] not in STATUSES:
        raise ErpError(400, "bad_change", f"status must be one of {STATUSES}")
    for name in ("planned_start", "planned_finish"):
        if name in fields:
            fields[name] = parse_date(fields[name], name, nullable=True)
    if "amount" in fields:
        fields["amount"] = _parse_amount(fields["amount"])
    for name in ("object_code", "title"):
        if name in fields and not isinstance(fields[name], str):
            raise ErpError(400, "bad_change", f"{name} must be a string")
    return dataclasses.replace(current, updated_at=updated_at, version=version,
                               deleted=op == "delete", **fields)


def parse_instant(text: Any, name: str) -> datetime:
    if not isinstance(text, str):
        raise ErpError(400, "bad_request", f"{name} is required (ISO-8601 with an offset)")
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        hint = " (a '+' in a query string must be sent as %2B)" if " " in text else ""
        raise ErpError(400, "bad_request", f"{name} is not ISO-8601: {text!r}{hint}") from None
    if parsed.utcoffset() is None:
        raise ErpError(400, "bad_request", f"{name} needs an offset: {text!r}")
    return parsed


def parse_date(text: Any, name: str, nullable: bool = False) -> date | None:
    if text is None and nullable:
        return None
    try:
        return date.fromisoformat(text)
    except (TypeError, ValueError):
        raise ErpError(400, "bad_request", f"{name} must be an ISO date: {text!r}") from None


def _parse_amount(text: Any) -> str:
    """A decimal string exact to the kopeck (a float would not be)."""
    try:
        amount = Decimal(text) if isinstance(text, str) else Decimal("NaN")
        exact = amount.is_finite() and amount == amount.quantize(_KOPECK)
    except InvalidOperation:  # too many digits to quantize
        exact = False
    if not exact:
        raise ErpError(400, "bad_change", f"amount must be roubles with kopecks: {text!r}")
    return f"{amount:.2f}"


def parse_base_id(id_: str) -> tuple[date, int] | None:
    matched = _BASE_ID.fullmatch(id_)
    if matched is None:
        return None
    try:
        return datetime.strptime(matched[1], "%Y%m%d").date(), int(matched[2])
    except ValueError:
        return None


def epoch_us(moment: datetime) -> int:
    return (moment - _EPOCH) // timedelta(microseconds=1)


def _day_start_us(day: date) -> int:
    return (day.toordinal() - _EPOCH_ORDINAL) * _DAY_US - _MSK_US


def day_of(us: int) -> date:
    """The Moscow date of an instant."""
    return date.fromordinal(_EPOCH_ORDINAL + (us + _MSK_US) // _DAY_US)


@functools.cache  # seeded planned dates stay within a few thousand days
def _date_json(ordinal: int) -> str:
    return f'"{date.fromordinal(ordinal).isoformat()}"' if ordinal else "null"


def _iso_date(day: date | None) -> str | None:
    return day.isoformat() if day else None
