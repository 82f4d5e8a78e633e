"""How the error taxonomy reads the S3 client's failures: a store that does not answer, or
answers that it cannot serve now, is an outage ridden out; a refusal is permanent."""

from __future__ import annotations

import errno

import pytest
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    ReadTimeoutError,
)

from mostovik_pipelines.core.errors import classify

URL = "http://127.0.0.1:9/bucket/key"


def _translated(code: str, status: int) -> OSError:
    """What s3fs raises for an S3 error code it has no Python exception for."""
    error = OSError(errno.EIO, code)
    error.__cause__ = ClientError({"Error": {"Code": code, "Message": code},
                                   "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
    return error


@pytest.mark.parametrize("error", [
    EndpointConnectionError(endpoint_url=URL),
    ReadTimeoutError(endpoint_url=URL, error="read timed out"),
    ConnectionClosedError(endpoint_url=URL),
    _translated("SlowDown", 503),
    _translated("InternalError", 500),
], ids=["refused", "read-timeout", "closed", "slow-down", "internal-error"])
def test_a_store_that_cannot_serve_now_is_an_outage(error):
    verdict = classify(error)
    assert verdict.transient and verdict.outage
    assert verdict.kind == "object_store_unreachable"


@pytest.mark.parametrize("error", [
    PermissionError("Access Denied"),  # s3fs's AccessDenied, InvalidAccessKeyId
    FileNotFoundError("The specified bucket does not exist"),
    _translated("InvalidRequest", 400),
], ids=["access-denied", "no-bucket", "invalid-request"])
def test_a_store_that_refuses_fails_at_once(error):
    verdict = classify(error)
    assert not verdict.transient and not verdict.outage
