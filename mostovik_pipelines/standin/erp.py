"""The project-management (ERP) work-orders API stand-in: ``GET /erp/api/v1/work-orders``.

``?updated_from=&updated_to=&page_size=&page_token=`` answers ``{"items": [...],
"next_page_token": ... | null}``: the work orders whose ``updated_at`` falls in
``[updated_from, updated_to)``, ordered by (``updated_at``, ``id``). The data is a seeded model
(fixed default seed), generated lazily one Moscow day at a time, so a 100,000-record day costs one
vectorised generation and every page after that is a binary search.

What a sync source must cope with (the contract, and quirks real APIs have that are modelled):

* Only a record's latest version is visible: a record updated again moves to the window of its
  new ``updated_at`` and vanishes from the old one. Deleted records stay as tombstones
  (``deleted: true`` with their other fields) in the window of their deletion.
* Window bounds are instants: ``+03:00``, ``Z`` or any other offset, compared correctly; a bound
  without an offset is a 400. A ``+`` sent unencoded arrives as a space (a 400 too).
* ``updated_at`` is printed in the offset it was written with: Moscow (``+03:00``) for the seeded
  records, the offset a test gave for a change. Compare instants, not strings.
* Nightly batch imports stamp many records with the very same ``updated_at``, so the ``id``
  decides the order and a page boundary often falls inside such a run.
* ``version`` comes from a global change sequence (a microsecond clock), so it exceeds 2**31.
* Page tokens are keyset cursors (the last ``(updated_at, id)`` served), signed, with no state on
  the server: they expire after a TTL or when all are expired at once, and an expired or unknown
  token is a 410. Records changing between pages behave as with any keyset pagination: a record
  moved past the cursor is served again, one moved out of the window is not.
* With a bearer token configured, a request without ``Authorization: Bearer <token>`` is a 401.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import dataclasses
import functools
import hmac
import json
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal, InvalidOperation
from heapq import merge
from typing import Any
from urllib.parse import parse_qs, unquote

import numpy as np

from mostovik_pipelines.standin.endpoint import (
    Endpoint,
    EndpointError,
    EndpointState,
    Request,
    Served,
)
from mostovik_pipelines.standin.reply import Reply

WORK_ORDERS_PATH = "/api/v1/work-orders"
"""Under the endpoint's path, ``/erp``: the source's base URL is the ERP's, not the API's."""
DEFAULT_SEED = 1
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_TOKEN_TTL_SECONDS = 600.0
MAX_DAY_RECORDS = 999_999  # ids number a day's records in six digits
MAX_VERSION = 2**63 - 1  # the ERP keeps versions in a bigint
# The seeded history; days outside it have records only if a test sets their volume.
FIRST_DAY = date(2020, 1, 1)
LAST_DAY = date(2030, 12, 31)
# Generated days kept in memory, counted in records (about 45 bytes each).
CACHE_RECORDS = 1_000_000

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
_MAC_BYTES = 16
_KOPECK = Decimal("0.01")
_TITLES_JSON = tuple(tuple(json.dumps(work.format(n=n), ensure_ascii=False) for n in range(40))
                     for work in WORKS)
_CHANGE_FIELDS = {"object_code", "title", "status", "planned_start", "planned_finish", "amount"}


class ErpError(EndpointError):
    """A request or control the ERP refuses: answered with ``status`` and a JSON error."""

    def __init__(self, status: int, error: str, message: str) -> None:
        super().__init__(status, message)
        self.error = error

    def reply(self) -> Reply:
        headers = {"WWW-Authenticate": 'Bearer realm="erp"'} if self.status == 401 else {}
        return json_reply(self.status, {"error": self.error, "message": self.message}, headers)


def json_reply(status: int, payload: Any, headers: dict[str, str] | None = None) -> Reply:
    """JSON in UTF-8, Russian text unescaped, as the ERP sends it."""
    return _json_text_reply(status, _json(payload), headers)


def _json_text_reply(status: int, text: str, headers: dict[str, str] | None = None) -> Reply:
    return Reply(status, text.encode(), "application/json; charset=utf-8", headers or {})


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


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
        self.us = _to_us(self.updated_at)

    @classmethod
    def from_item(cls, item: dict[str, Any]) -> WorkOrder:
        return cls(
            id=item["id"],
            object_code=item["object_code"],
            title=item["title"],
            status=item["status"],
            planned_start=_parse_date(item["planned_start"], "planned_start", nullable=True),
            planned_finish=_parse_date(item["planned_finish"], "planned_finish", nullable=True),
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
        return _json(self.item())


@dataclass(frozen=True)
class _Window:
    """What a page token continues: the bounds as instants, the page size, and the bounds as
    the client wrote them (for faults that ``match`` a window's later pages)."""

    from_us: int
    to_us: int
    page_size: int
    asked_from: str
    asked_to: str


@dataclass
class _Base:
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


@dataclass
class _DayView:
    """A day's visible records in (updated_at, id) order: the seeded ones not changed since,
    merged with the changed records whose latest ``updated_at`` falls on the day."""

    base: _Base
    us: np.ndarray
    src: np.ndarray  # >= 0: a seeded record's number; < 0: -1 - its place in ``moved_in``
    moved_in: list[WorkOrder]

    def id_at(self, position: int) -> str:
        source = int(self.src[position])
        return self.base.id_of(source) if source >= 0 else self.moved_in[-1 - source].id

    def fragments(self, begin: int, end: int) -> list[str]:
        sources = self.src[begin:end]
        is_seeded = sources >= 0
        if is_seeded.all():  # most pages
            return self.base.fragments(sources)
        seeded = iter(self.base.fragments(sources[is_seeded]))
        return [next(seeded) if source >= 0 else self.moved_in[-1 - source].fragment()
                for source in sources.tolist()]

    def first_from(self, us: int) -> int:
        """The first position at or after the instant ``us``."""
        return int(np.searchsorted(self.us, us, "left"))

    def first_after(self, us: int, id_: str) -> int:
        """The first position whose (updated_at, id) comes after ``(us, id_)``: a keyset seek."""
        lo = int(np.searchsorted(self.us, us, "left"))
        hi = int(np.searchsorted(self.us, us, "right"))
        return bisect.bisect_right(range(len(self.us)), id_, lo, hi, key=self.id_at)


class _Day:
    """A cached day: its seeded records, and their merged view until a change touches the day."""

    def __init__(self, base: _Base) -> None:
        self.base = base
        self.view: _DayView | None = None


class ErpStandin(EndpointState):
    """The seeded work orders, the changes tests made to them, and the API's settings."""

    faults = frozenset({"expire_token"})

    def __init__(self, token: str | None = None) -> None:
        self._lock = threading.Lock()
        self._configured_token = token
        self._key = secrets.token_bytes(32)  # tokens of another server instance are unknown
        # Expired tokens stay expired through a reset, as they would on the real server.
        self._epoch = 0
        self._revoked: set[bytes] = set()
        self.reset()

    def reset(self, seed: int | None = None) -> None:
        """Back to the seeded base state and the settings the stand-in was started with (tokens
        expired so far stay expired)."""
        seed = DEFAULT_SEED if seed is None else seed
        if not isinstance(seed, int) or seed < 0:
            raise ErpError(400, "bad_seed", "seed must be a non-negative integer")
        with self._lock:
            self._seed = seed
            self._volumes: dict[date, int] = {}
            self._changed: dict[str, WorkOrder] = {}
            self._hidden: dict[date, set[int]] = {}  # seeded records superseded by a change
            self._moved_in: dict[date, dict[str, WorkOrder]] = {}  # changes, by updated_at day
            self._cache: OrderedDict[date, _Day] = OrderedDict()
            self._cached_records = 0
            self._token = self._configured_token
            self._ttl = DEFAULT_PAGE_TOKEN_TTL_SECONDS

    # -- controls

    def set_token(self, token: str | None) -> None:
        """Require ``Authorization: Bearer <token>`` (None: no authentication)."""
        if token is not None and (not isinstance(token, str) or not token):
            raise ErpError(400, "bad_token", "token must be a non-empty string or null")
        with self._lock:
            self._token = token

    def set_page_token_ttl(self, seconds: float) -> None:
        """Applies to tokens already issued too: they carry their issue time, not a deadline."""
        if not isinstance(seconds, int | float) or seconds < 0:
            raise ErpError(400, "bad_ttl", "ttl_seconds must be a non-negative number")
        with self._lock:
            self._ttl = float(seconds)

    def expire_page_tokens(self) -> None:
        """Every token issued so far answers 410 from now on."""
        with self._lock:
            self._epoch += 1

    def set_volume(self, day: str, records: int) -> None:
        """How many seeded records ``day`` (a Moscow date) has; regenerates that day."""
        when = _parse_date(day, "day")
        if when is None or not isinstance(records, int) or not 0 <= records <= MAX_DAY_RECORDS:
            raise ErpError(400, "bad_volume", f"records must be 0..{MAX_DAY_RECORDS} for a day")
        with self._lock:
            self._volumes[when] = records
            self._evict(when)

    def apply_changes(self, changes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Apply ``update``, ``delete`` (tombstone) and ``restore`` changes, all or none; returns
        each change's resulting record."""
        if not isinstance(changes, list):
            raise ErpError(400, "bad_change", "changes must be a list")
        with self._lock:
            staged: dict[str, WorkOrder] = {}
            results = []
            for change in changes:
                if not isinstance(change, dict) or not isinstance(change.get("id"), str):
                    raise ErpError(400, "bad_change", f"a change needs an id: {change!r}")
                current = staged.get(change["id"]) or self._current(change["id"])
                staged[current.id] = _changed(current, change)
                results.append(staged[current.id])
            for record in staged.values():
                self._store(record)
        return [record.item() for record in results]

    def window_state(self, query: dict[str, list[str]]) -> Reply:
        """The oracle, ``{"items": [...]}``: the current state of every record whose
        ``updated_at`` falls in the window, in order. Found by filtering and sorting whole
        days, not by the API's seeks."""
        window = _window(query)
        found: list[tuple[int, str, str]] = []
        with self._lock:
            for day in self._days(window.from_us, window.to_us):
                base = self._day(day).base
                inside = np.flatnonzero((base.us >= window.from_us) & (base.us < window.to_us))
                inside = inside[~np.isin(inside, list(self._hidden.get(day, ())))]
                found.extend(zip(base.us[inside].tolist(), map(base.id_of, inside.tolist()),
                                 base.fragments(inside), strict=True))
                found.extend((r.us, r.id, r.fragment())
                             for r in self._moved_in.get(day, {}).values()
                             if window.from_us <= r.us < window.to_us)
        found.sort(key=lambda key_and_item: key_and_item[:2])
        return _json_text_reply(200, f'{{"items":[{",".join(item for *_, item in found)}]}}')

    # -- the API

    def serve(self, request: Request) -> Served:
        """Answer ``GET /api/v1/work-orders?<query>``. A fault's ``match`` is looked for in the
        query, plus the window's bounds for a request that carries only a page token; ``page``
        is the page of its window asked for (1 without a token)."""
        if request.path != WORK_ORDERS_PATH:
            return Served(ErpError(404, "not_found", f"no such resource {request.path}").reply(),
                          unquote(request.query))
        return self._serve_page(request.query, request.headers.get("Authorization"))

    def control(self, method: str, name: str, params: dict[str, list[str]],
                body: dict[str, Any]) -> Any:
        if (method, name) == ("GET", "work-orders"):
            return self.window_state(params)
        if method != "POST":
            return None
        if name == "reset":
            self.reset(body.get("seed"))
            return {"reset": True}
        if name == "volume":
            self.set_volume(body.get("day"), body.get("records"))
            return {"day": body["day"], "records": body["records"]}
        if name == "changes":
            return {"changed": self.apply_changes(body.get("changes"))}
        if name == "auth":
            self.set_token(body.get("token"))
            return {"token_required": body.get("token") is not None}
        if name == "page_tokens":
            self.set_page_token_ttl(body.get("ttl_seconds"))
            return {"ttl_seconds": body["ttl_seconds"]}
        if name == "page_tokens/expire":
            self.expire_page_tokens()
            return {"expired": True}
        raise ErpError(404, "unknown_control", f"unknown control /_control/erp/{name}")

    def refuse_fault(self, kind: str, options: Mapping[str, Any]) -> str | None:
        if kind == "expire_token" and int(options.get("page", 0)) < 2:
            return "expire_token needs route erp and page >= 2, the first page carries no token"
        return None

    def fault(self, kind: str, options: Mapping[str, Any], served: Served) -> Reply:
        return self.expire(served.page_token)

    def _serve_page(self, raw_query: str, authorization: str | None) -> Served:
        match_text = unquote(raw_query)
        query = parse_qs(raw_query)
        token_text = _one(query, "page_token")
        page = None
        try:
            with self._lock:
                self._authorize(authorization)
                if token_text:
                    window, cursor, page = self._open(token_text)
                    match_text += f"&updated_from={window.asked_from}&updated_to={window.asked_to}"
                    _check_same_query(query, window)
                else:
                    window, cursor, page = _window(query), None, 1
                items, more = self._page(window, cursor)
                next_token = self._issue(window, items[-1], page + 1) if more else None
        except ErpError as error:
            return Served(error.reply(), match_text, page, token_text)
        body = f'{{"items":[{",".join(items)}],"next_page_token":{_json(next_token)}}}'
        return Served(_json_text_reply(200, body), match_text, page, token_text)

    def expire(self, page_token: str | None) -> Reply:
        """Expire one token for good (an ``expire_token`` fault) and answer as for any
        expired token."""
        if page_token:
            with self._lock:
                self._revoked.add(_mac_of(page_token))
        return _expired().reply()

    # -- pages

    def _authorize(self, authorization: str | None) -> None:
        if self._token is None:
            return
        scheme, _, credentials = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                credentials.strip().encode(), self._token.encode()):
            raise ErpError(401, "unauthorized", "a valid 'Authorization: Bearer' token is needed")

    def _page(self, window: _Window, cursor: tuple[int, str] | None
              ) -> tuple[list[str], bool]:
        """The page after ``cursor`` (or the window's first) as items' JSON text, and whether
        more follow."""
        wanted = window.page_size + 1  # one more tells whether there is a next page
        found: list[str] = []
        start = cursor[0] if cursor else window.from_us
        for day in self._days(start, window.to_us):
            view = self._view(day)
            begin = view.first_from(window.from_us)
            if cursor:
                begin = max(begin, view.first_after(*cursor))
            end = min(view.first_from(window.to_us), begin + wanted - len(found))
            found.extend(view.fragments(begin, end))
            if len(found) == wanted:
                break
        return found[:window.page_size], len(found) == wanted

    def _issue(self, window: _Window, last_item: str, page: int) -> str:
        last = json.loads(last_item)
        cursor = [_to_us(datetime.fromisoformat(last["updated_at"])), last["id"]]
        payload = {"w": [window.from_us, window.to_us, window.page_size, window.asked_from,
                         window.asked_to],
                   "c": cursor, "p": page, "i": time.monotonic(), "e": self._epoch}
        raw = json.dumps(payload, separators=(",", ":")).encode()
        mac = hmac.digest(self._key, raw, "sha256")[:_MAC_BYTES]
        return base64.urlsafe_b64encode(raw + mac).rstrip(b"=").decode()

    def _open(self, token: str) -> tuple[_Window, tuple[int, str], int]:
        """A token's window, cursor and page number; 410 if it is unknown or expired."""
        try:
            signed = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        except (binascii.Error, ValueError):
            raise _expired() from None
        raw, mac = signed[:-_MAC_BYTES], signed[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, hmac.digest(self._key, raw, "sha256")[:_MAC_BYTES]):
            raise _expired()
        payload = json.loads(raw)
        if (payload["e"] != self._epoch or mac in self._revoked
                or time.monotonic() - payload["i"] > self._ttl):
            raise _expired()
        from_us, to_us, page_size, asked_from, asked_to = payload["w"]
        cursor_us, cursor_id = payload["c"]
        return (_Window(from_us, to_us, page_size, asked_from, asked_to),
                (cursor_us, cursor_id), payload["p"])

    # -- the model

    def _days(self, start_us: int, to_us: int) -> Iterator[date]:
        """The Moscow days of ``[start_us, to_us)`` that can hold records, in order."""
        if start_us >= to_us:
            return
        first, last = _day_of(start_us), _day_of(to_us - 1)
        outside = sorted(day for day in {*self._volumes, *self._moved_in}
                         if first <= day <= last and not FIRST_DAY <= day <= LAST_DAY)
        seeded = range(max(first, FIRST_DAY).toordinal(), min(last, LAST_DAY).toordinal() + 1)
        yield from merge(outside, map(date.fromordinal, seeded))

    def _volume(self, day: date) -> int:
        if day in self._volumes:
            return self._volumes[day]
        if not FIRST_DAY <= day <= LAST_DAY:
            return 0
        rng = np.random.default_rng([self._seed, day.toordinal(), 0])
        low, high = {5: (0, 10), 6: (0, 3)}.get(day.weekday(), (20, 60))
        return int(rng.integers(low, high, endpoint=True))

    def _day(self, day: date) -> _Day:
        entry = self._cache.get(day)
        if entry is not None:
            self._cache.move_to_end(day)
            return entry
        entry = self._cache[day] = _Day(_generate(self._seed, day, self._volume(day)))
        self._cached_records += len(entry.base.us)
        while self._cached_records > CACHE_RECORDS and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_records -= len(old.base.us)
        return entry

    def _evict(self, day: date) -> None:
        entry = self._cache.pop(day, None)
        if entry is not None:
            self._cached_records -= len(entry.base.us)

    def _view(self, day: date) -> _DayView:
        entry = self._day(day)
        if entry.view is None:
            entry.view = self._merge(entry.base)
        return entry.view

    def _merge(self, base: _Base) -> _DayView:
        # A stable sort keeps equal instants in record-number order, which is id order.
        order = np.argsort(base.us, kind="stable")
        hidden = self._hidden.get(base.day)
        if hidden:
            order = order[~np.isin(order, np.fromiter(hidden, np.int64, len(hidden)))]
        view = _DayView(base, base.us[order], order.astype(np.int64), [])
        moved_in = sorted(self._moved_in.get(base.day, {}).values(), key=lambda r: (r.us, r.id))
        if not moved_in:
            return view
        at = [view.first_after(record.us, record.id) for record in moved_in]
        return _DayView(base, np.insert(view.us, at, [record.us for record in moved_in]),
                        np.insert(view.src, at, -1 - np.arange(len(moved_in))), moved_in)

    def _current(self, id_: str) -> WorkOrder:
        if id_ in self._changed:
            return self._changed[id_]
        parsed = _parse_base_id(id_)
        if parsed is None or parsed[1] >= self._volume(parsed[0]):
            raise ErpError(404, "not_found", f"no work order {id_}")
        return self._day(parsed[0]).base.record(parsed[1])

    def _store(self, record: WorkOrder) -> None:
        """Make ``record`` the latest version: out of its old day's view, into its new day's."""
        old = self._changed.get(record.id)
        if old is not None:
            old_day = _day_of(old.us)
            del self._moved_in[old_day][record.id]
            if not self._moved_in[old_day]:
                del self._moved_in[old_day]
            self._invalidate(old_day)
        else:
            seeded = _parse_base_id(record.id)
            assert seeded is not None, "only seeded records exist to be changed"
            self._hidden.setdefault(seeded[0], set()).add(seeded[1])
            self._invalidate(seeded[0])
        new_day = _day_of(record.us)
        self._moved_in.setdefault(new_day, {})[record.id] = record
        self._changed[record.id] = record
        self._invalidate(new_day)

    def _invalidate(self, day: date) -> None:
        entry = self._cache.get(day)
        if entry is not None:
            entry.view = None


def _generate(seed: int, day: date, n: int) -> _Base:
    rng = np.random.default_rng([seed, day.toordinal(), 1])
    in_batch = rng.random(n) < _BATCH_SHARE
    batch_time = _BATCH_TIMES[rng.integers(0, len(_BATCH_TIMES), n)]
    work_time = rng.integers(*_WORKDAY_US, n)
    start = day.toordinal() + rng.integers(-60, 60, n, endpoint=True)
    finish = start + rng.integers(1, 120, n, endpoint=True)
    undated = rng.random(n)
    # Roubles from 10 thousand to 50 million, log-uniform like real estimates.
    roubles = np.exp(rng.uniform(np.log(1e4), np.log(5e7), n))
    return _Base(
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


def _changed(current: WorkOrder, change: dict[str, Any]) -> WorkOrder:
    """The record after one change; refuses what the real ERP cannot do."""
    op = change.get("op", "update")
    unknown = set(change) - {"op", "id", "updated_at", "version"} - _CHANGE_FIELDS
    if op not in ("update", "delete", "restore") or unknown or (
            op == "delete" and _CHANGE_FIELDS & set(change)):
        raise ErpError(400, "bad_change", f"unknown op or fields in {change!r}")
    if current.deleted != (op == "restore"):
        state = "deleted" if current.deleted else "not deleted"
        raise ErpError(409, "conflict", f"{current.id} is {state}: cannot {op} it")
    updated_at = _parse_instant(change.get("updated_at"), "updated_at")
    if updated_at <= current.updated_at:
        raise ErpError(409, "conflict", f"{current.id}: updated_at must be later than "
                                        f"{current.updated_at.isoformat()}")
    version = change.get("version", max(current.version + 1, _to_us(updated_at)))
    if not isinstance(version, int) or not current.version < version <= MAX_VERSION:
        raise ErpError(409, "conflict", f"{current.id}: version must grow from "
                                        f"{current.version} and fit a bigint")
    fields: dict[str, Any] = {name: change[name] for name in _CHANGE_FIELDS & set(change)}
    if "status" in fields and fields["status"] not in STATUSES:
        raise ErpError(400, "bad_change", f"status must be one of {STATUSES}")
    for name in ("planned_start", "planned_finish"):
        if name in fields:
            fields[name] = _parse_date(fields[name], name, nullable=True)
    if "amount" in fields:
        fields["amount"] = _parse_amount(fields["amount"])
    for name in ("object_code", "title"):
        if name in fields and not isinstance(fields[name], str):
            raise ErpError(400, "bad_change", f"{name} must be a string")
    return dataclasses.replace(current, updated_at=updated_at, version=version,
                               deleted=op == "delete", **fields)


def _window(query: dict[str, list[str]]) -> _Window:
    asked_from, asked_to = _one(query, "updated_from"), _one(query, "updated_to")
    from_us = _to_us(_parse_instant(asked_from, "updated_from"))
    to_us = _to_us(_parse_instant(asked_to, "updated_to"))
    if from_us > to_us:
        raise ErpError(400, "bad_request", "updated_from is later than updated_to")
    page_size = _one(query, "page_size") or str(DEFAULT_PAGE_SIZE)
    if not page_size.isdigit() or not 1 <= int(page_size) <= MAX_PAGE_SIZE:
        raise ErpError(400, "bad_request", f"page_size must be 1..{MAX_PAGE_SIZE}")
    return _Window(from_us, to_us, int(page_size), asked_from or "", asked_to or "")


def _check_same_query(query: dict[str, list[str]], window: _Window) -> None:
    """A token continues its own query: repeating its parameters is fine, changing them is not
    (AIP-158 style)."""
    for name, value in (("updated_from", window.from_us), ("updated_to", window.to_us)):
        asked = _one(query, name)
        if asked is not None and _to_us(_parse_instant(asked, name)) != value:
            raise ErpError(400, "bad_request", f"page_token was issued for another {name}")
    asked_size = _one(query, "page_size")
    if asked_size is not None and asked_size != str(window.page_size):
        raise ErpError(400, "bad_request", "page_token was issued for another page_size")


def _expired() -> ErpError:
    return ErpError(410, "page_token_expired",
                    "the page token is expired or unknown: start the window again")


def _mac_of(token: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))[-_MAC_BYTES:]
    except (binascii.Error, ValueError):
        return b""


def _one(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    return values[0] if values else None


def _parse_instant(text: Any, name: str) -> datetime:
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


def _parse_date(text: Any, name: str, nullable: bool = False) -> date | None:
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


def _parse_base_id(id_: str) -> tuple[date, int] | None:
    matched = _BASE_ID.fullmatch(id_)
    if matched is None:
        return None
    try:
        return datetime.strptime(matched[1], "%Y%m%d").date(), int(matched[2])
    except ValueError:
        return None


def _to_us(moment: datetime) -> int:
    return (moment - _EPOCH) // timedelta(microseconds=1)


def _day_start_us(day: date) -> int:
    return (day.toordinal() - _EPOCH_ORDINAL) * _DAY_US - _MSK_US


def _day_of(us: int) -> date:
    """The Moscow date of an instant."""
    return date.fromordinal(_EPOCH_ORDINAL + (us + _MSK_US) // _DAY_US)


@functools.cache  # seeded planned dates stay within a few thousand days
def _date_json(ordinal: int) -> str:
    return f'"{date.fromordinal(ordinal).isoformat()}"' if ordinal else "null"


def _iso_date(day: date | None) -> str | None:
    return day.isoformat() if day else None


ENDPOINT = Endpoint(source="erp_work_orders", route="erp", path="/erp",
                    state=lambda options: ErpStandin(options.get("erp_token")))
