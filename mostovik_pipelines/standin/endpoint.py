"""A source's stand-in endpoint, found by convention.

A source folder's ``standin.py`` (``mostovik_pipelines/sources/<name>/standin.py``) that
declares ``ENDPOINT = Endpoint(...)`` stands in for the source it names: the stand-in server
serves it at its ``path``, ``mostovik demo`` and ``make dev`` point the source's ``url_setting``
at it, and the tests wire the source's resource to it. A new source's stand-in is that one
module and nothing else; this package holds only what every endpoint shares.

An endpoint's state (:class:`EndpointState`) answers requests at its path and, for tests, the
controls at ``/_control/<route>/<name>``; the server adds the faults every endpoint shares
(status codes, hangs, dropped connections, raw bytes...).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import parse_qs, unquote

from mostovik_pipelines.standin.reply import Reply

SOURCES_PACKAGE = "mostovik_pipelines.sources"
"""Where the source folders are, each maybe with a ``standin.py``."""


@dataclass(frozen=True)
class Request:
    """A request at an endpoint: the path under the endpoint's own, the query as sent."""

    path: str
    query: str
    headers: Mapping[str, str]

    @property
    def params(self) -> dict[str, list[str]]:
        return parse_qs(self.query)


@dataclass(frozen=True)
class Served:
    """A request as answered, with what the server's fault queue matches faults against."""

    reply: Reply
    match_text: str
    """What a fault's ``match`` is looked for in (the decoded query, by default)."""
    page: int | None = None
    """Which page of its window a paged request asked for, when the endpoint knows."""
    page_token: str | None = None


class EndpointError(Exception):
    """A request or control the endpoint refuses; answered with :meth:`reply`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def reply(self) -> Reply:
        return Reply(self.status, self.message.encode(), "text/plain; charset=utf-8")


class EndpointState:
    """What an endpoint holds while the server runs: its data and what tests changed."""

    faults: frozenset[str] = frozenset()
    """Fault kinds of this endpoint's own, beyond the server's (see :meth:`fault`)."""

    def serve(self, request: Request) -> Served:
        raise NotImplementedError

    def control(self, method: str, name: str, params: dict[str, list[str]],
                body: dict[str, Any]) -> Any:
        """Answer ``<method> /_control/<route>/<name>``: a :class:`Reply`, or what to send as
        JSON; None when there is no such control."""
        return None

    def reset(self) -> None:
        """Forget what tests changed (``DELETE /_control/<route>``)."""

    def learn_holidays(self, days: list[str]) -> None:
        """The working days its source does not publish on, on top of weekends (``POST
        /_control/<route>/holidays`` ``{"dates": ["2026-11-04"]}``). An endpoint whose source
        does not follow a calendar ignores them."""

    def set_clock(self, at: datetime | None) -> None:
        """What the source has published by ``at`` is what it answers (``POST
        /_control/<route>/clock`` ``{"at": "2026-11-04T16:30:00+03:00" | null}``): a test on a
        fake clock tells every endpoint the instant its processes read. None: the real clock.
        An endpoint whose answers do not depend on the time ignores it."""

    def refuse_fault(self, kind: str, options: Mapping[str, Any]) -> str | None:
        """Why a fault of the endpoint's own kinds cannot be queued with these options."""
        return None

    def fault(self, kind: str, options: Mapping[str, Any], served: Served) -> Reply:
        """The answer for a fault of the endpoint's own kinds instead of ``served``."""
        raise NotImplementedError(kind)


@dataclass(frozen=True)
class Endpoint:
    """A source's stand-in, as its folder's ``standin.py`` declares it (``ENDPOINT``)."""

    source: str
    """The name of the source it stands in for."""
    route: str
    """Its name for faults, controls and the request log (``cbr``)."""
    path: str
    """Where it is served; the source's base URL is the server's URL plus this path."""
    state: Callable[[Mapping[str, Any]], EndpointState]
    """Makes the endpoint's state for a server, from the server's options (``erp_token``)."""


def discover_endpoints() -> dict[str, Endpoint]:
    """Every endpoint declared by a source folder's ``standin.py``, by the name of its source."""
    sources = importlib.import_module(SOURCES_PACKAGE)
    found: dict[str, Endpoint] = {}
    for folder in sorted(pkgutil.iter_modules(sources.__path__), key=lambda m: m.name):
        name = f"{SOURCES_PACKAGE}.{folder.name}.standin"
        if not folder.ispkg or importlib.util.find_spec(name) is None:
            continue
        endpoint = getattr(importlib.import_module(name), "ENDPOINT", None)
        if not isinstance(endpoint, Endpoint):
            continue
        if endpoint.source in found:
            raise ValueError(f"two stand-in endpoints for source {endpoint.source}")
        if any(other.route == endpoint.route for other in found.values()):
            raise ValueError(f"two stand-in endpoints named {endpoint.route}")
        found[endpoint.source] = endpoint
    return found


def decoded(query: str) -> str:
    """What a fault's ``match`` is looked for in by default: the query, decoded."""
    return unquote(query)
