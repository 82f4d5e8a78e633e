"""The HTTP source resource's TLS: an https source's certificate is verified against the CA
bundle; a plain-http source's client, which never loads the bundle, trusts no certificate."""

from __future__ import annotations

import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from dagster import build_init_resource_context

from mostovik_pipelines.resources.http import HttpSourceResource, tls_context_for


@pytest.fixture
def self_signed_https(tmp_path: Path) -> Iterator[str]:
    """An https endpoint whose certificate (for 127.0.0.1) no CA signed: no request reaches it,
    since a client that verifies ends the handshake."""
    key, certificate = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(certificate), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(certificate, key)
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}/daily"
    finally:
        server.shutdown()
        server.server_close()


def _fetch(url: str, params: dict[str, str] | None = None) -> bytes:
    resource = HttpSourceResource(base_url=url, timeout_seconds=5)
    resource.setup_for_execution(build_init_resource_context())
    try:
        return resource.get(params).content
    finally:
        resource.teardown_after_execution(build_init_resource_context())


def test_a_plain_http_source_is_fetched(standin_server):
    assert b"<ValCurs" in _fetch(standin_server.cbr_url, {"date_req": "04/12/2026"})


def test_an_https_source_whose_certificate_no_ca_signed_is_refused(self_signed_https):
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        _fetch(self_signed_https)
    assert tls_context_for(self_signed_https).cert_store_stats()["x509_ca"] > 0


def test_the_client_of_a_plain_http_source_trusts_no_certificate(self_signed_https):
    """It never shakes hands (its requests go to its base URL; redirects are not followed), and
    if it did, the handshake would fail, never pass unverified."""
    context = tls_context_for("http://127.0.0.1/daily")
    assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname
    assert context.cert_store_stats()["x509_ca"] == 0
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(self_signed_https, verify=context, timeout=5)
