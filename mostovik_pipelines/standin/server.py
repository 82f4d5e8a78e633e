"""A local stand-in for the external sources: a real HTTP server on 127.0.0.1 that serves each
source's format deterministically and injects the faults tests ask for.

It serves every endpoint a source declares (:mod:`.endpoint`: a source folder's ``standin.py``
with ``ENDPOINT``), each at its path: ``/cbr/XML_daily.asp`` (route ``cbr``,
:mod:`mostovik_pipelines.sources.cbr_daily_rates.standin`), ``/erp`` (route ``erp``,
:mod:`mostovik_pipelines.sources.erp_work_orders.standin`, work orders at
``/erp/api/v1/work-orders``), ... A source's base URL is
:meth:`StandinServer.endpoint_url`.

Control endpoints (JSON), used by tests and the chaos suite through :class:`.client.StandinClient`:

* ``POST /_control/faults`` ``{"route": "cbr", "kind": ..., "times": 1, ...}`` queues a fault
  for the next requests of a route (only those whose query contains ``match``, if given; on the
  ``erp`` route a request carrying only a page token matches as if it repeated its window's
  ``updated_from`` and ``updated_to``; with ``page``: k, only the k-th page of a window, counted
  from 1); ``DELETE /_control/faults`` clears them. Kinds:
  ``status`` (any code, optional ``retry_after``), ``hang`` (``seconds`` before answering, or
  until ``POST /_control/faults/release`` lets every hanging request answer at once),
  ``drop`` (close the connection halfway through the body), ``truncate`` (a cut-off document),
  ``malformed`` (not XML), ``rename_element`` (``element`` -> ``renamed_to``, a schema change),
  ``wrong_encoding`` (bytes that do not match the declared encoding), ``html`` (a maintenance
  page with status 200), ``body`` (``content`` text in ``encoding``), ``raw`` (exact bytes,
  ``content_b64``, with optional ``content_type`` and ``status``), and on the ``erp`` route
  ``expire_token`` (with ``page`` >= 2: the token that asks for that page expires for good, 410).
* ``GET /_control/requests`` lists the latest 10,000 requests served (route, query, time,
  status, fault, page, and ``clock``: the fake instant it was served at, for a route told one);
  ``DELETE /_control/requests`` forgets them. ``GET /_control/hanging``
  lists the requests hanging now (route, query as a fault's ``match`` reads it, since): what a
  test waits on before it acts.
* ``<method> /_control/<route>/<name>``: an endpoint's own controls; ``DELETE
  /_control/<route>`` forgets what tests changed in it; ``POST /_control/<route>/holidays``
  ``{"dates": [...]}`` teaches it the days off its source keeps; ``POST /_control/<route>/clock``
  ``{"at": ISO instant | null}`` tells it the instant a fake-clock test runs at (what the source
  has published by then).
* CBR: ``POST /_control/cbr/changes``, ``POST /_control/cbr/published_until``,
  ``DELETE /_control/cbr/changes`` (see :mod:`mostovik_pipelines.sources.cbr_daily_rates.standin`).
* ERP (errors answer 400/404/409 with ``{"error", "message"}``):
  ``POST /_control/erp/reset`` ``{"seed": 1}`` back to the seeded base state and start-up settings;
  ``POST /_control/erp/volume`` ``{"day": "2026-11-03", "records": 100000}``;
  ``POST /_control/erp/changes`` ``{"changes": [{"op": "update" | "delete" | "restore", "id",
  "updated_at", "version"?, fields?}]}`` applies all or none and answers ``{"changed": [items]}``;
  ``GET /_control/erp/work-orders?updated_from=&updated_to=`` the oracle, ``{"items": [...]}``:
  every record whose latest ``updated_at`` falls in the window, what a perfect sync holds;
  ``POST /_control/erp/auth`` ``{"token": "..." | null}`` the bearer token required;
  ``POST /_control/erp/page_tokens`` ``{"ttl_seconds": 600}``;
  ``POST /_control/erp/page_tokens/expire`` expires every page token issued so far.
"""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from mostovik_pipelines.standin.endpoint import (
    Endpoint,
    EndpointError,
    EndpointState,
    Request,
    Served,
    discover_endpoints,
)
from mostovik_pipelines.standin.reply import Reply

# Enough for any test to inspect, bounded so that paging a big window does not grow memory.
REQUEST_LOG_SIZE = 10_000
SHARED_FAULTS = frozenset({"status", "hang", "drop", "truncate", "malformed", "rename_element",
                           "wrong_encoding", "html", "raw", "body"})
"""Fault kinds every endpoint has; an endpoint may add its own (:attr:`EndpointState.faults`)."""


@dataclass
class Fault:
    kind: str
    times: int = 1
    """How many requests it applies to; -1 for every request until cleared."""
    options: dict[str, Any] = field(default_factory=dict)


class StandinState:
    """Every endpoint's state, faults queued per route and the log of requests served; shared
    by handler threads."""

    def __init__(self, endpoints: dict[str, Endpoint], options: dict[str, Any]) -> None:
        self.lock = threading.Lock()
        self.faults: dict[str, list[Fault]] = {}
        self.requests: deque[dict[str, Any]] = deque(maxlen=REQUEST_LOG_SIZE)
        self.hanging: dict[int, dict[str, Any]] = {}
        self.release = threading.Event()
        """Set to let the requests hanging now answer; a new one for the hangs to come."""
        self.endpoints = sorted(endpoints.values(), key=lambda e: len(e.path), reverse=True)
        self.states: dict[str, EndpointState] = {
            endpoint.route: endpoint.state(options) for endpoint in self.endpoints}
        self.clock_offsets: dict[str, float] = {}
        """Per route told a fake instant: its offset from the real clock (the request log's
        ``clock``)."""

    def endpoint_at(self, path: str) -> Endpoint | None:
        """The endpoint serving ``path``: the one whose path is the longest prefix of it."""
        return next((e for e in self.endpoints
                     if path == e.path or path.startswith(e.path.rstrip("/") + "/")), None)

    def next_fault(self, route: str, query: str, page: int | None = None) -> Fault | None:
        """The first queued fault of the route that applies to this request (a fault with a
        ``match`` option applies only to requests whose query string contains it, one with a
        ``page`` option only to that page of a window)."""
        with self.lock:
            queue = self.faults.get(route, [])
            for fault in queue:
                if fault.options.get("match", "") not in query:
                    continue
                if "page" in fault.options and fault.options["page"] != page:
                    continue
                if fault.times > 0:
                    fault.times -= 1
                    if fault.times == 0:
                        queue.remove(fault)
                return fault
            return None


def _make_handler(state: StandinState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in separate writes; on a kept-alive connection Nagle's
        # algorithm would hold the body for the client's delayed ACK (~40 ms a request).
        disable_nagle_algorithm = True

        def log_message(self, *args: Any) -> None:  # keep test output quiet
            pass

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path == "/_control/requests":
                with state.lock:
                    self._send_json(200, list(state.requests))
                return
            if url.path == "/_control/hanging":
                with state.lock:
                    self._send_json(200, list(state.hanging.values()))
                return
            if url.path.startswith("/_control/"):
                self._control("GET", url.path, parse_qs(url.query), {})
                return
            endpoint = state.endpoint_at(url.path)
            if endpoint is None:
                self._send(Reply(404, b"not found", "text/plain"))
                return
            endpoint_state = state.states[endpoint.route]
            served = endpoint_state.serve(Request(
                url.path.removeprefix(endpoint.path), url.query, self.headers))
            fault = state.next_fault(endpoint.route, served.match_text, served.page)
            # Logged as the reply starts to go out, before its client can read it: a client
            # that got its answer finds the request in the log.
            self._served = {"route": endpoint.route, "query": url.query,
                            "fault": fault.kind if fault else None, "page": served.page}
            try:
                self._serve(served, fault, endpoint_state, endpoint.route)
            finally:
                # A request stops hanging once it is in the log (or its client has gone).
                self._served = None
                with state.lock:
                    state.hanging.pop(id(self), None)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            path = urlsplit(self.path).path
            if path == "/_control/faults":
                self._queue_fault(body)
            elif path == "/_control/faults/release":
                with state.lock:
                    released, state.release = state.release, threading.Event()
                    count = len(state.hanging)
                released.set()
                self._send_json(200, {"released": count})
            else:
                self._control("POST", path, {}, body)

        def do_DELETE(self) -> None:
            path = urlsplit(self.path).path
            if path == "/_control/faults":
                with state.lock:
                    state.faults.clear()
            elif path == "/_control/requests":
                with state.lock:
                    state.requests.clear()
            else:
                self._control("DELETE", path, {}, {})
                return
            self._send_json(200, {"cleared": path})

        def _queue_fault(self, body: dict[str, Any]) -> None:
            fault = Fault(kind=body.pop("kind"), times=int(body.pop("times", 1)), options=body)
            route = fault.options.pop("route", "cbr")
            if "page" in fault.options:
                fault.options["page"] = int(fault.options["page"])
            endpoint_state = state.states.get(route)
            if endpoint_state is None:
                self._send_json(400, {"error": f"no stand-in endpoint named {route}"})
                return
            if fault.kind not in SHARED_FAULTS and fault.kind not in endpoint_state.faults:
                self._send_json(400, {"error": f"no fault {fault.kind} on route {route}"})
                return
            refused = endpoint_state.refuse_fault(fault.kind, fault.options)
            if refused:
                self._send_json(400, {"error": refused})
                return
            with state.lock:
                state.faults.setdefault(route, []).append(fault)
            self._send_json(200, {"queued": fault.kind, "route": route})

        def _control(self, method: str, path: str, params: dict[str, list[str]],
                     body: dict[str, Any]) -> None:
            """``/_control/<route>[/<name>]``: the endpoint's own control, answered with what it
            returns (a reply, or a payload to send as JSON) or with the error it raises."""
            route, _, name = path.removeprefix("/_control/").partition("/")
            endpoint_state = state.states.get(route)
            try:
                if endpoint_state is None:
                    result = None
                elif method == "DELETE" and not name:
                    endpoint_state.reset()
                    result = {"reset": route}
                elif (method, name) == ("POST", "holidays"):
                    endpoint_state.learn_holidays(list(body.get("dates") or []))
                    result = {"holidays": body.get("dates") or []}
                elif (method, name) == ("POST", "clock"):
                    at = body.get("at")
                    instant = datetime.fromisoformat(at) if at else None
                    endpoint_state.set_clock(instant)
                    with state.lock:
                        if instant is None:
                            state.clock_offsets.pop(route, None)
                        else:
                            state.clock_offsets[route] = instant.timestamp() - time.time()
                    result = {"clock": at}
                else:
                    result = endpoint_state.control(method, name, params, body)
            except EndpointError as error:
                result = error.reply()
            if result is None:
                self._send_json(404, {"error": f"unknown control {path}"})
            else:
                self._send(result if isinstance(result, Reply) else Reply(
                    200, json.dumps(result, ensure_ascii=False).encode(),
                    "application/json; charset=utf-8"))

        def _serve(self, served: Served, fault: Fault | None, endpoint_state: EndpointState,
                   route: str) -> int:
            reply = served.reply
            if fault is None:
                return self._send(reply)
            kind, options = fault.kind, fault.options
            if kind in endpoint_state.faults:
                return self._send(endpoint_state.fault(kind, options, served))
            if kind == "status":
                headers = {}
                if "retry_after" in options:
                    headers["Retry-After"] = str(options["retry_after"])
                code = int(options.get("status", 503))
                return self._send(Reply(code, f"fault {code}".encode(), "text/plain", headers))
            if kind == "hang":
                self._hang(float(options.get("seconds", 30)), route, served.match_text)
                return self._send(reply)
            if kind == "drop":
                self._log_served(200)
                self.send_response(200)
                self.send_header("Content-Type", reply.content_type)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body[: len(reply.body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return 200
            if kind == "truncate":
                cut = reply.body[: len(reply.body) // 2]
                return self._send(Reply(200, cut, reply.content_type))
            if kind == "malformed":
                return self._send(Reply(200, b"<ValCurs Date=\"01.01.2026\"><Valute ID=",
                                        reply.content_type))
            if kind == "rename_element":
                old, new = options.get("element", "Value"), options.get("renamed_to", "Rate")
                body = reply.body.replace(f"<{old}>".encode(), f"<{new}>".encode()).replace(
                    f"</{old}>".encode(), f"</{new}>".encode())
                return self._send(Reply(200, body, reply.content_type))
            if kind == "wrong_encoding":
                body = reply.body.replace(b'encoding="windows-1251"', b'encoding="utf-8"')
                return self._send(Reply(200, body, reply.content_type))
            if kind == "html":
                page = b"<html><body><h1>Maintenance</h1></body></html>"
                return self._send(Reply(200, page, "text/html"))
            if kind == "raw":
                content = base64.b64decode(options.get("content_b64", ""))
                return self._send(Reply(int(options.get("status", 200)), content,
                                        options.get("content_type", reply.content_type)))
            if kind == "body":
                content = options.get("content", "").encode(options.get("encoding", "utf-8"))
                return self._send(Reply(int(options.get("status", 200)), content,
                                        options.get("content_type", reply.content_type)))
            return self._send(Reply(500, f"unknown fault {kind}".encode(), "text/plain"))

        def _hang(self, seconds: float, route: str, match_text: str) -> None:
            with state.lock:
                release = state.release
                state.hanging[id(self)] = {"route": route, "query": match_text,
                                           "since": time.time()}
            release.wait(seconds)

        def _log_served(self, status: int) -> None:
            served, self._served = getattr(self, "_served", None), None
            if served is not None:
                with state.lock:
                    now = time.time()
                    offset = state.clock_offsets.get(served["route"])
                    state.requests.append({**served, "at": now, "status": status, "clock": (
                        now + offset if offset is not None else None)})

        def _send(self, reply: Reply) -> int:
            self._log_served(reply.status)
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(reply.body)
            return reply.status

        def _send_json(self, status: int, payload: Any) -> None:
            self._send(Reply(status, json.dumps(payload).encode(), "application/json"))

    return Handler


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that gave up (timed out during a ``hang``, was killed) is expected here."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class StandinServer:
    """The stand-in on 127.0.0.1, in a background thread of the calling process."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 erp_token: str | None = None) -> None:
        self.endpoints = discover_endpoints()
        self.state = StandinState(self.endpoints, {"erp_token": erp_token})
        self.httpd = _QuietServer((host, port), _make_handler(self.state))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def endpoint_url(self, source: str) -> str:
        """The base URL that points ``source`` at its stand-in endpoint."""
        if source not in self.endpoints:
            raise KeyError(f"no stand-in endpoint for source {source}: add "
                           f"mostovik_pipelines/sources/{source}/standin.py declaring ENDPOINT")
        return f"{self.url}{self.endpoints[source].path}"

    @property
    def cbr_url(self) -> str:
        return self.endpoint_url("cbr_daily_rates")

    @property
    def erp_url(self) -> str:
        """The ERP's base URL (``MOSTOVIK_ERP_URL``); work orders are at
        ``{erp_url}/api/v1/work-orders``."""
        return self.endpoint_url("erp_work_orders")

    def start(self) -> StandinServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def serve_forever(self) -> None:
        self.httpd.serve_forever()
