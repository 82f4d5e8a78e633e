"""The one-time set-up of a machine for the test servers, done once and checked, never raced.

The tests start throw-away PostgreSQL, Redis and Prometheus servers. They need the servers'
binaries (the Debian packages ``postgresql``, ``redis-server`` and ``prometheus``), libfaketime
(``faketime``: the fake clock the daemon's schedule tests run on) and, when run as root, a
system user that owns the PostgreSQL cluster (``initdb`` refuses to run as root).
``make system-deps`` runs this module once, before any test worker starts: it installs what is
missing (as root, with apt), creates the user, and checks that the user can run ``initdb``.
Anything a test worker may still find missing (pytest started by hand) is set up under one file
lock, so two workers never race to create the same user.

As a non-root user nothing is created: the servers run as that user, and a missing binary is
named with the command that installs it.
"""

from __future__ import annotations

import fcntl
import glob
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SERVER_USER = "mostovik-pg"
"""Owns the throw-away PostgreSQL clusters when the tests run as root."""
SETUP_LOCK = Path(tempfile.gettempdir()) / "mostovik-test-machine.lock"
PACKAGES = {"initdb": "postgresql", "pg_ctl": "postgresql", "redis-server": "redis-server",
            "faketime": "faketime", "prometheus": "prometheus"}
"""Each binary the tests start, and the Debian package that brings it (``faketime`` brings the
libfaketime that support/fake_clock.py preloads; ``prometheus`` scrapes `mostovik metrics`)."""
ROOT_PACKAGES = {"s3fs": "s3fs"}
"""What only root's tests use (mounting object storage with FUSE): installed when run as root,
not asked for otherwise."""


class MachineNotReady(RuntimeError):
    """A binary or the server user is missing and this process cannot set it up."""


def binary(name: str) -> str | None:
    """The path of a server binary: the newest PostgreSQL's own, else what PATH finds."""
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    if candidates:
        return candidates[0]
    if Path(f"/usr/bin/{name}").exists():
        return f"/usr/bin/{name}"
    return shutil.which(name)


def require_binary(name: str) -> str:
    """The path of ``name``, or an error naming the package that brings it and how."""
    found = binary(name)
    if found is None:
        raise MachineNotReady(
            f"{name} not found: install the Debian package {PACKAGES.get(name, name)} "
            f"(`make system-deps` as root does it with apt-get)")
    return found


NO_SERVERS = "MOSTOVIK_TESTS_NO_SERVERS"
"""Set by ``make check``: a test that starts a server there is one its marking missed."""


def refuse_server_in_quick_check(server: str) -> None:
    """Fails a ``make check`` test that starts ``server``: conftest marks the tests that need
    one (``servers``) from their fixtures and markers, and ``make check`` leaves those out."""
    if os.environ.get(NO_SERVERS):
        raise MachineNotReady(
            f"this test starts {server} under make check: mark it `servers` "
            f"(pytest.mark.servers, or a fixture conftest's SERVER_FIXTURES names)")


def missing_packages() -> list[str]:
    """The Debian packages whose binaries are missing, each named once."""
    wanted = {**PACKAGES, **(ROOT_PACKAGES if os.geteuid() == 0 else {})}
    return sorted({package for name, package in wanted.items() if binary(name) is None})


@contextmanager
def _setup_lock() -> Iterator[None]:
    with SETUP_LOCK.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_server_user(name: str = SERVER_USER) -> None:
    """Create the system user ``name`` if it is missing (root only), under the set-up lock so
    that concurrent callers create it once; a no-op for a non-root process. The user is looked
    up under the lock too: ``useradd`` writes the user's files one after another, and a process
    that found it half-written failed in ``initdb``."""
    if os.geteuid() != 0:
        return
    with _setup_lock():
        if _user_exists(name):
            return
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", name], check=True, capture_output=True, text=True)
    if not _user_exists(name):
        raise MachineNotReady(f"useradd created no user {name}")


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _install(packages: list[str]) -> None:
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise MachineNotReady(
            f"missing Debian packages: {' '.join(packages)}; as root run "
            f"`apt-get install -y {' '.join(packages)}` (or `make system-deps` as root)")
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=environment)
    subprocess.run(["apt-get", "install", "-y", "-q", *packages], check=True, env=environment)


def _check_server_user_runs_initdb() -> None:
    if os.geteuid() != 0:
        return
    result = subprocess.run(["runuser", "-u", SERVER_USER, "--", require_binary("initdb"),
                             "--version"], capture_output=True, text=True)
    if result.returncode != 0:
        raise MachineNotReady(f"{SERVER_USER} cannot run initdb: {result.stderr.strip()}")


def prepare() -> None:
    """Everything the test servers need on this machine, installed or created where missing,
    then checked."""
    missing = missing_packages()
    if missing:
        _install(missing)
        still = missing_packages()
        if still:
            raise MachineNotReady(f"still missing after apt-get: {' '.join(still)}")
    ensure_server_user()
    _check_server_user_runs_initdb()


def main() -> int:
    try:
        prepare()
    except (MachineNotReady, subprocess.CalledProcessError) as error:
        print(f"make system-deps: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
