"""An object store that fails the way a real one does, for tests: moto's S3 API server in a
process of its own (its buckets live as long as it does), reached only through a front on
127.0.0.1 that passes each request on or fails it as the test says.

The front is an HTTP relay, request by request (a kept-alive connection meets a fault on its
next request, as with a real store behind a load balancer), in one of these states:

* ``up``: every request passed to the server and its answer back;
* ``refusing``: the port closed, every open connection dropped (a store restarting, a network
  route gone): the client's connect is refused;
* ``throttling``: every request answered ``503 SlowDown``, S3's "reduce your request rate";
* ``hanging``: every request read and never answered (a store that stopped answering): the
  client's read times out; once ``up`` again, a request still held is passed on;
* ``vanishing``: every request passed on, but its answer cut off half way through the body and
  the connection reset (a store whose node died mid-transfer);
* ``denying``: every request answered ``403 AccessDenied`` (a key revoked, a policy changed):
  not an outage, a refusal that lasts.

:attr:`S3Front.environment` is what a process of the deployment needs (``AWS_*`` only, the
endpoint being the front's); :attr:`S3Front.buckets` reads and writes the server directly,
around the front, as an operator's console does.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler

from mostovik_pipelines_tests.support.object_store import Buckets, S3ApiServer
from mostovik_pipelines_tests.support.postgres import free_port

UP, REFUSING, THROTTLING, HANGING, VANISHING, DENYING = (
    "up", "refusing", "throttling", "hanging", "vanishing", "denying")
STATES = (UP, REFUSING, THROTTLING, HANGING, VANISHING, DENYING)
OUTAGES = (REFUSING, THROTTLING, HANGING, VANISHING)
"""The states of a store that is away or cannot serve now: ridden out within the budget."""
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection"}
ERROR_XML = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
             "<Message>{message}</Message><RequestId>front</RequestId></Error>")
ANSWERS = {
    THROTTLING: (503, "SlowDown", "Please reduce your request rate."),
    DENYING: (403, "AccessDenied", "Access Denied"),
}


class S3Front:
    """moto's S3 API server behind the fault front; start, set a state, close."""

    def __init__(self) -> None:
        self.server = S3ApiServer()
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.state = UP
        self.requests: dict[str, int] = {}
        """Requests the front met in each state (``up``: passed on and answered)."""
        self._changed = threading.Condition()
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def environment(self) -> dict[str, str]:
        return {**self.server.environment, "AWS_ENDPOINT_URL": self.endpoint}

    @property
    def secret(self) -> str:
        return self.server.secret

    @property
    def buckets(self) -> Buckets:
        """The server's buckets, read and written around the front."""
        return self.server.buckets

    def bucket(self, name: str) -> str:
        """Create the bucket ``name`` (around the front); its URL."""
        return self.server.bucket(name)

    def start(self) -> S3Front:
        self.server.start()
        self._listen()
        return self

    def close(self) -> None:
        self.set(REFUSING)
        self.server.close()

    def set(self, state: str) -> None:
        """Put the front in ``state`` (one of :data:`STATES`) from now on."""
        assert state in STATES, state
        with self._changed:
            previous, self.state = self.state, state
            self._changed.notify_all()
        if state in (REFUSING, VANISHING) and previous not in (REFUSING, VANISHING):
            self._drop_connections()
        if state == REFUSING and self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            self._listener.close()
            self._listener = None
        elif state != REFUSING and self._listener is None:
            self._listen()

    def up(self) -> None:
        self.set(UP)

    # --- the relay ---------------------------------------------------------------------------

    def _listen(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                connection, address = listener.accept()
            except OSError:
                return
            with self._lock:
                self._connections.add(connection)
            threading.Thread(target=self._serve, args=(connection, address), daemon=True).start()

    def _serve(self, connection: socket.socket, address) -> None:
        try:
            _Handler(connection, address, self)
        except OSError:
            pass
        finally:
            with self._lock:
                self._connections.discard(connection)
            with contextlib.suppress(OSError):
                connection.close()

    def _drop_connections(self) -> None:
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            _reset(connection)

    def _count(self, state: str) -> None:
        with self._lock:
            self.requests[state] = self.requests.get(state, 0) + 1

    def _hold_while_hanging(self) -> str:
        """Wait while the front hangs; the state it left hanging for."""
        with self._changed:
            self._changed.wait_for(lambda: self.state != HANGING)
            return self.state


class _Handler(BaseHTTPRequestHandler):
    """One client connection: each request answered as the front's state says."""

    protocol_version = "HTTP/1.1"
    server: S3Front

    def log_message(self, format, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._relay()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _relay(self) -> None:
        front = self.server
        body = self._body()
        state = front.state
        if state == HANGING:
            front._count(HANGING)
            state = front._hold_while_hanging()
        if state == REFUSING:
            front._count(REFUSING)
            _reset(self.connection)
            self.close_connection = True
            return
        if state in ANSWERS:
            front._count(state)
            self._answer_error(*ANSWERS[state])
            return
        status, reason, headers, answer = self._pass_on(body)
        if state == VANISHING and front.state == VANISHING:
            front._count(VANISHING)
            self._send_head(status, reason, headers, len(answer))
            self.wfile.write(answer[:len(answer) // 2])
            self.wfile.flush()
            _reset(self.connection)
            self.close_connection = True
            return
        front._count(UP)
        self._send_head(status, reason, headers, len(answer))
        if self.command != "HEAD":
            self.wfile.write(answer)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _pass_on(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        target = http.client.HTTPConnection("127.0.0.1", self.server.server.port, timeout=120)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Content-Length"] = str(len(body))
        try:
            target.request(self.command, self.path, body=body, headers=headers)
            response = target.getresponse()
            answer = response.read()
            kept = [(k, v) for k, v in response.getheaders() if k.lower() not in HOP_BY_HOP]
            if self.command == "HEAD":
                # A HEAD's length is the object's, not the (empty) answer's.
                length = response.getheader("Content-Length")
                kept = [(k, v) for k, v in kept if k.lower() != "content-length"]
                kept.append(("Content-Length", length or "0"))
            return response.status, response.reason, kept, answer
        finally:
            target.close()

    def _send_head(self, status: int, reason: str, headers: list[tuple[str, str]],
                   length: int) -> None:
        self.send_response_only(status, reason)
        for name, value in headers:
            if name.lower() in ("server", "date") or (
                    name.lower() == "content-length" and self.command != "HEAD"):
                continue
            self.send_header(name, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def _answer_error(self, status: int, code: str, message: str) -> None:
        answer = ERROR_XML.format(code=code, message=message).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(answer)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(answer)


def _reset(connection: socket.socket) -> None:
    """Drop ``connection`` with a reset, as a dead server's kernel does."""
    with contextlib.suppress(OSError):
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)
