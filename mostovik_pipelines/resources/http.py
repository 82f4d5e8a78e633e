"""HTTP access to an external source, turning status codes into the error taxonomy."""

from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from dagster import ConfigurableResource, InitResourceContext
from pydantic import PrivateAttr

from mostovik_pipelines.core.errors import (
    ConfigurationError,
    SourceRateLimited,
    SourceRequestRejected,
    SourceUnavailable,
)

if TYPE_CHECKING:
    import httpx


@dataclass(frozen=True)
class HttpResponse:
    content: bytes
    content_type: str
    url: str
    """The URL asked, without credentials: safe to log and to keep in the landing record."""


class HttpSourceResource(ConfigurableResource):
    """An external HTTP endpoint. Non-2xx answers become classified errors: 429 and 5xx are
    transient (with ``Retry-After`` when sent), other 4xx are permanent."""

    base_url: str
    timeout_seconds: float = 30.0
    token: str | None = None
    """Bearer token, from an ``EnvVar``; never logged."""

    _client: httpx.Client | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: InitResourceContext) -> None:
        # One client per step: its connection pool serves every request of a ranged run,
        # instead of a new handshake per partition. The client library is imported by the step
        # that calls the source, not by every process that loads the code location.
        import httpx

        self._client = httpx.Client(timeout=self.timeout_seconds,
                                    verify=tls_context_for(self.base_url))

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def get(self, params: dict[str, str] | None = None, path: str = "") -> HttpResponse:
        url = self._url(path)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if self._client is not None:
            response = self._client.get(url, params=params, headers=headers)
        else:
            import httpx

            response = httpx.get(url, params=params, headers=headers,
                                 timeout=self.timeout_seconds, verify=tls_context_for(url))
        shown = _without_credentials(str(response.request.url))
        raise_for_status(response, shown)
        return HttpResponse(
            content=response.content,
            content_type=response.headers.get("Content-Type", "application/octet-stream"),
            url=shown,
        )

    def _url(self, path: str) -> str:
        parts = urlsplit(self.base_url)
        if parts.scheme not in {"http", "https"} or not parts.netloc:
            raise ConfigurationError(
                f"invalid source URL {_without_credentials(self.base_url)!r}: "
                "expected http(s)://host/path"
            )
        return self.base_url.rstrip("/") + "/" + path.lstrip("/") if path else self.base_url


def tls_context_for(url: str) -> ssl.SSLContext:
    """The TLS context of a source's client. An ``https`` source gets the CA bundle's. A plain
    ``http`` source (the stand-ins, a service inside the network) never shakes hands, since
    every request goes to its base URL and redirects are not followed: it gets a context that
    trusts no certificate, so a handshake could only fail, and its step does not load the
    bundle (about 20 ms a process on this machine)."""
    return _ca_bundle() if urlsplit(url).scheme == "https" else _trusting_nothing()


@functools.cache
def _ca_bundle() -> ssl.SSLContext:
    """Loaded once per process: a Celery worker or the daemon would otherwise pay it again for
    every step it runs."""
    import httpx

    return httpx.create_ssl_context()


@functools.cache
def _trusting_nothing() -> ssl.SSLContext:
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies certificates, and trusts none


def raise_for_status(response: httpx.Response, shown: str) -> None:
    """A non-2xx answer as a classified error naming ``shown`` (what was asked, never a
    credential): 429 and 5xx transient (with ``Retry-After`` when sent), other 4xx permanent."""
    if response.status_code == 429:
        raise SourceRateLimited(
            f"HTTP 429 rate limited by {shown}", status=429,
            retry_after=parse_retry_after(response.headers.get("Retry-After")),
        )
    if response.status_code >= 500:
        raise SourceUnavailable(
            f"HTTP {response.status_code} from {shown}", status=response.status_code,
            retry_after=parse_retry_after(response.headers.get("Retry-After")),
        )
    if response.status_code >= 400:
        raise SourceRequestRejected(
            f"HTTP {response.status_code} from {shown}", status=response.status_code
        )


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delta-seconds, or an HTTP date in any of
    the three forms RFC 9110 accepts (IMF-fixdate, RFC 850, asctime), with its zone spelled
    ``GMT``, ``UTC``, ``Z``, ``+0300`` or not at all (read as GMT, as the RFC says). Anything
    unreadable is None: the caller then backs off on its own, never fails because of a header."""
    if not value or not value.strip():
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max((when - (now or datetime.now(UTC))).total_seconds(), 0.0)


def _without_credentials(url: str) -> str:
    parts = urlsplit(url)
    if parts.username or parts.password:
        netloc = parts.hostname or ""
        if parts.port:
            netloc += f":{parts.port}"
        return urlunsplit(parts._replace(netloc=netloc))
    return url
