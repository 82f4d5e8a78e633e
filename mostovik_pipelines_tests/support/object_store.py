"""Object storage for the tests: an S3 API server (moto's, a process of its own on 127.0.0.1).

Two ways of using it. :class:`S3ApiServer` is the server the stores reach natively, over the S3
API (``s3://bucket/prefix``), with the throw-away credentials and endpoint handed to the code
through the ``AWS_*`` environment only, as a deployment does; it can be stopped and started
again on the same port, for an outage. moto keeps its buckets in the memory of the process that
serves them: a server of its own process comes back empty, so an outage test serves from a
thread of the test's process (``keeps_buckets_across_restarts``), whose buckets come back
with it, as a real store's do. :func:`mounted_buckets` mounts a bucket per store with
s3fs-fuse where the store's directory would be, deploy/README's other option; what a prune did
is then read twice: through the mount, as the code sees it, and as the bucket's objects, as the
operator's S3 console shows them. Mounting needs root (FUSE); :func:`why_no_object_store` says
why not."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from mostovik_pipelines_tests.support.machine import refuse_server_in_quick_check
from mostovik_pipelines_tests.support.postgres import free_port
from mostovik_pipelines_tests.support.processes import stop_process
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until


def why_no_object_store() -> str | None:
    """None where :func:`mounted_buckets` can work here, else the reason."""
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        return "mounting object storage with s3fs-fuse needs root and /dev/fuse"
    if shutil.which("s3fs") is None:
        return "s3fs not found: install the Debian package s3fs (`make system-deps` as root)"
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as missing:
        return f"the S3 API server for the tests is missing ({missing}): `make install-dev`"
    return None


def why_no_s3_api() -> str | None:
    """None where :class:`S3ApiServer` and the stores' S3 client can work here, else why not."""
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as missing:
        return f"the S3 API server or client is missing ({missing}): `make install-dev`"
    return None


class S3ApiServer:
    """moto's S3 API server on 127.0.0.1, with credentials of its own: :attr:`environment` is
    what a process of the deployment needs to reach it (``AWS_*`` variables only)."""

    def __init__(self, keeps_buckets_across_restarts: bool = False) -> None:
        self.in_process = keeps_buckets_across_restarts
        self._threaded = None
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        key, secret = secrets.token_hex(8), secrets.token_urlsafe(24)
        self.secret = secret
        self.environment = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                            "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        self._server: subprocess.Popen | None = None
        self.buckets: Buckets | None = None

    def start(self) -> S3ApiServer:
        refuse_server_in_quick_check("an S3 API server")
        if self.in_process:
            from moto.server import ThreadedMotoServer

            first = self._threaded is None
            self._threaded = ThreadedMotoServer("127.0.0.1", self.port, verbose=False)
            self._threaded.start()
            self.buckets = Buckets(self.endpoint, self.environment)
            if first:  # the process's buckets of an earlier test are not this server's
                urllib.request.urlopen(urllib.request.Request(
                    f"{self.endpoint}/moto-api/reset", method="POST"), timeout=30).close()
            return self
        self._server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.buckets = _when_serving(self._server, self._log,
                                     lambda: Buckets(self.endpoint, self.environment))
        return self

    def stop(self) -> None:
        """Stop the server (an outage of the store): it refuses connections until
        :meth:`start` brings it back."""
        if self._threaded is not None:
            self._threaded.stop()
            self._threaded._server.server_close()  # stop() leaves the port listening
            return
        stop_process(self._server, 10)

    def close(self) -> None:
        self.stop()
        self._log.close()

    def bucket(self, name: str) -> str:
        """Create the bucket ``name``; its URL."""
        self.buckets.client.create_bucket(Bucket=name)
        return f"s3://{name}"


@contextlib.contextmanager
def s3_in_environment(monkeypatch, keeps_buckets_across_restarts: bool = False
                      ) -> Iterator[S3ApiServer]:
    """An S3 API server of the test's own, its credentials and endpoint in this process's
    environment (``AWS_*``, through pytest's ``monkeypatch``), as a deployment hands them to
    the stores; closed after."""
    from s3fs import S3FileSystem

    server = S3ApiServer(keeps_buckets_across_restarts=keeps_buckets_across_restarts).start()
    for name, value in server.environment.items():
        monkeypatch.setenv(name, value)
    # A process keeps one client per store, made from the environment it had then: a test's
    # server is another endpoint with other credentials.
    S3FileSystem.clear_instance_cache()
    try:
        yield server
    finally:
        server.close()
        S3FileSystem.clear_instance_cache()


class Buckets:
    """The buckets behind the mounts, read over the S3 API."""

    def __init__(self, endpoint: str, environment: dict[str, str]) -> None:
        import boto3

        self.client = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id=environment["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=environment["AWS_SECRET_ACCESS_KEY"])

    def objects(self, name: str, prefix: str = "") -> set[str]:
        """Every object's key in the bucket mounted at ``name`` (or named ``name``), under
        ``prefix``; s3fs's directory markers (keys ending in ``/``) left out."""
        keys = set()
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket_for(name),
                                                                      Prefix=prefix)
        for page in pages:
            keys.update(item["Key"] for item in page.get("Contents", []))
        return {key for key in keys if not key.endswith("/")}


@contextlib.contextmanager
def mounted_buckets(work_dir: Path, names: tuple[str, ...]) -> Iterator[Buckets]:
    """A bucket per name, mounted at ``work_dir / name``; unmounted and the server stopped on
    the way out. A name may be a relative path (``killed/landing``): its bucket is
    :func:`bucket_for` it."""
    server = S3ApiServer().start()
    credentials = server.environment
    # Handed to s3fs-fuse through its environment only, under the names it reads.
    environment = {**os.environ, **credentials,
                   "AWSACCESSKEYID": credentials["AWS_ACCESS_KEY_ID"],
                   "AWSSECRETACCESSKEY": credentials["AWS_SECRET_ACCESS_KEY"]}
    try:
        with _mounted(server.buckets, names, work_dir, server.endpoint, environment):
            yield server.buckets
    finally:
        server.close()


def bucket_for(name: str) -> str:
    """The bucket mounted at ``name`` (a bucket's name holds no ``/``)."""
    return name.replace("/", "-")


@contextlib.contextmanager
def _mounted(buckets: Buckets, names: tuple[str, ...], work_dir: Path, endpoint: str,
             environment: dict[str, str]) -> Iterator[None]:
    mounted: list[Path] = []
    try:
        for name in names:
            buckets.client.create_bucket(Bucket=bucket_for(name))
            mount_point = work_dir / name
            mount_point.mkdir(parents=True, exist_ok=True)
            subprocess.run(["s3fs", bucket_for(name), str(mount_point), "-o",
                            f"url={endpoint},use_path_request_style,dbglevel=warn"],
                           env=environment, check=True, capture_output=True, text=True)
            mounted.append(mount_point)
            wait_until(lambda mount_point=mount_point: os.path.ismount(mount_point),
                       PROCESS_START_MARGIN_SECONDS, f"s3fs mounting {mount_point}")
        yield
    finally:
        for mount_point in mounted:
            subprocess.run(["umount", "-l", str(mount_point)], check=False, capture_output=True)


def _when_serving(server: subprocess.Popen, log, connect) -> Buckets:
    """The buckets' client once the server answers; fails at once, with its log, if it died."""
    def answering() -> Buckets | None:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the S3 API server exited: "
                               f"{log.read()[-2000:].decode(errors='replace')}")
        try:
            buckets = connect()
            buckets.client.list_buckets()
            return buckets
        except Exception:  # any failure to answer is "not yet"
            return None

    return wait_until(answering, PROCESS_START_MARGIN_SECONDS, "the S3 API server answering")
