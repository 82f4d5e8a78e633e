"""A local stand-in for the external sources: a real HTTP server on 127.0.0.1 that serves each
source's format deterministically and injects the faults tests ask for.

Control endpoints (JSON), used by tests and the chaos suite through :class:`StandinClient`:

* ``POST /_control/faults`` ``{"route": "cbr", "kind": ..., "times": 1, ...}`` queues a fault
  for the next requests of a route (only those whose query contains ``match``, if given);
  ``DELETE /_control/faults`` clears them. Kinds:
  ``status`` (any code, optional ``retry_after``), ``hang`` (``seconds`` before answering),
  ``drop`` (close the connection halfway through the body), ``truncate`` (a cut-off document),
  ``malformed`` (not XML), ``rename_element`` (``element`` -> ``renamed_to``, a schema change),
  ``wrong_encoding`` (bytes that do not match the declared encoding), ``html`` (a maintenance
  page with status 200), ``body`` (``content`` text in ``encoding``), ``raw`` (exact bytes,
  ``content_b64``, with optional ``content_type`` and ``status``).
* ``GET /_control/requests`` lists the requests served (route, query, time, status);
  ``DELETE /_control/requests`` forgets them.
* Routes add their own controls (see :mod:`.cbr`).
"""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import httpx

from mostovik_pipelines.standin.cbr import CbrStandin
from mostovik_pipelines.standin.reply import Reply


@dataclass
class Fault:
    kind: str
    times: int = 1
    """How many requests it applies to; -1 for every request until cleared."""
    options: dict[str, Any] = field(default_factory=dict)


class StandinState:
    """Faults queued per route and the log of requests served; shared by handler threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.faults: dict[str, list[Fault]] = {}
        self.requests: list[dict[str, Any]] = []
        self.cbr = CbrStandin()

    def next_fault(self, route: str, query: str) -> Fault | None:
        """The first queued fault of the route that applies to this request (a fault with a
        ``match`` option applies only to requests whose query string contains it)."""
        with self.lock:
            queue = self.faults.get(route, [])
            for fault in queue:
                if fault.options.get("match", "") not in query:
                    continue
                if fault.times > 0:
                    fault.times -= 1
                    if fault.times == 0:
                        queue.remove(fault)
                return fault
            return None


def _make_handler(state: StandinState) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, Callable[[dict[str, list[str]]], Reply]] = {
        "/cbr/XML_daily.asp": lambda query: state.cbr.reply(query),
    }
    route_names = {"/cbr/XML_daily.asp": "cbr"}

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
            if url.path not in routes:
                self._send(Reply(404, b"not found", "text/plain"))
                return
            query = parse_qs(url.query)
            route = route_names[url.path]
            reply = routes[url.path](query)
            fault = state.next_fault(route, unquote(url.query))
            status = self._serve(reply, fault)
            with state.lock:
                state.requests.append({"route": route, "query": url.query, "at": time.time(),
                                       "status": status,
                                       "fault": fault.kind if fault else None})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            path = urlsplit(self.path).path
            if path == "/_control/faults":
                fault = Fault(kind=body.pop("kind"), times=int(body.pop("times", 1)),
                              options=body)
                route = fault.options.pop("route", "cbr")
                with state.lock:
                    state.faults.setdefault(route, []).append(fault)
                self._send_json(200, {"queued": fault.kind, "route": route})
            elif path == "/_control/cbr/changes":
                state.cbr.change(body["date"], body.get("set", {}), body.get("remove", []))
                self._send_json(200, {"changed": body["date"]})
            elif path == "/_control/cbr/published_until":
                state.cbr.set_published_until(body.get("date"))
                self._send_json(200, {"published_until": body.get("date")})
            else:
                self._send_json(404, {"error": f"unknown control {path}"})

        def do_DELETE(self) -> None:
            path = urlsplit(self.path).path
            with state.lock:
                if path == "/_control/faults":
                    state.faults.clear()
                elif path == "/_control/requests":
                    state.requests.clear()
                elif path == "/_control/cbr/changes":
                    state.cbr.reset()
            self._send_json(200, {"cleared": path})

        def _serve(self, reply: Reply, fault: Fault | None) -> int:
            if fault is None:
                return self._send(reply)
            kind, options = fault.kind, fault.options
            if kind == "status":
                headers = {}
                if "retry_after" in options:
                    headers["Retry-After"] = str(options["retry_after"])
                code = int(options.get("status", 503))
                return self._send(Reply(code, f"fault {code}".encode(), "text/plain", headers))
            if kind == "hang":
                time.sleep(float(options.get("seconds", 30)))
                return self._send(reply)
            if kind == "drop":
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

        def _send(self, reply: Reply) -> int:
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

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.state = StandinState()
        self.httpd = _QuietServer((host, port), _make_handler(self.state))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def cbr_url(self) -> str:
        return f"{self.url}/cbr/XML_daily.asp"

    def start(self) -> StandinServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def serve_forever(self) -> None:
        self.httpd.serve_forever()


class StandinClient:
    """Drives a running stand-in's controls (from tests, or across processes)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def fault(self, kind: str, *, route: str = "cbr", times: int = 1, **options: Any) -> None:
        self._post("/_control/faults", {"kind": kind, "route": route, "times": times, **options})

    def serve_bytes(self, content: bytes, *, route: str = "cbr", times: int = 1,
                    **options: Any) -> None:
        """Answer the next requests with exactly ``content`` (a ``raw`` fault)."""
        self.fault("raw", route=route, times=times,
                   content_b64=base64.b64encode(content).decode("ascii"), **options)

    def clear_faults(self) -> None:
        httpx.delete(f"{self.base_url}/_control/faults").raise_for_status()

    def requests(self, route: str | None = None) -> list[dict[str, Any]]:
        served = httpx.get(f"{self.base_url}/_control/requests").json()
        return [r for r in served if route is None or r["route"] == route]

    def forget_requests(self) -> None:
        httpx.delete(f"{self.base_url}/_control/requests").raise_for_status()

    def change_cbr_rates(self, day: str, set_values: dict[str, str] | None = None,
                         remove: list[str] | None = None) -> None:
        self._post("/_control/cbr/changes",
                   {"date": day, "set": set_values or {}, "remove": remove or []})

    def reset_cbr_rates(self) -> None:
        httpx.delete(f"{self.base_url}/_control/cbr/changes").raise_for_status()

    def publish_cbr_until(self, day: str | None) -> None:
        self._post("/_control/cbr/published_until", {"date": day})

    def _post(self, path: str, payload: dict[str, Any]) -> None:
        httpx.post(f"{self.base_url}{path}", json=payload).raise_for_status()
