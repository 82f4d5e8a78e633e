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
import hmac
import json
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any
from urllib.parse import parse_qs, unquote

import numpy as np

from mostovik_pipelines.sources.erp_work_orders.standin_history import CachedDay, WorkOrderHistory
from mostovik_pipelines.sources.erp_work_orders.standin_records import (
    DEFAULT_SEED,
    MAX_DAY_RECORDS,
    WorkOrder,
    changed,
    epoch_us,
    parse_date,
    parse_instant,
)
from mostovik_pipelines.sources.erp_work_orders.standin_replies import (
    ErpError,
    json_text,
    json_text_reply,
)
from mostovik_pipelines.standin.endpoint import Endpoint, EndpointState, Request, Served
from mostovik_pipelines.standin.reply import Reply

WORK_ORDERS_PATH = "/api/v1/work-orders"
"""Under the endpoint's path, ``/erp``: the source's base URL is the ERP's, not the API's."""
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_TOKEN_TTL_SECONDS = 600.0
_MAC_BYTES = 16


@dataclass(frozen=True)
class _Window:
    """What a page token continues: the bounds as instants, the page size, and the bounds as
    the client wrote them (for faults that ``match`` a window's later pages)."""

    from_us: int
    to_us: int
    page_size: int
    asked_from: str
    asked_to: str


class ErpStandin(WorkOrderHistory, EndpointState):
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
            self._cache: OrderedDict[date, CachedDay] = OrderedDict()
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
        when = parse_date(day, "day")
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
                staged[current.id] = changed(current, change)
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
        return json_text_reply(200, f'{{"items":[{",".join(item for *_, item in found)}]}}')

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
        body = f'{{"items":[{",".join(items)}],"next_page_token":{json_text(next_token)}}}'
        return Served(json_text_reply(200, body), match_text, page, token_text)

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
        cursor = [epoch_us(datetime.fromisoformat(last["updated_at"])), last["id"]]
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


def _window(query: dict[str, list[str]]) -> _Window:
    asked_from, asked_to = _one(query, "updated_from"), _one(query, "updated_to")
    from_us = epoch_us(parse_instant(asked_from, "updated_from"))
    to_us = epoch_us(parse_instant(asked_to, "updated_to"))
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
        if asked is not None and epoch_us(parse_instant(asked, name)) != value:
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


ENDPOINT = Endpoint(source="erp_work_orders", route="erp", path="/erp",
                    state=lambda options: ErpStandin(options.get("erp_token")))
