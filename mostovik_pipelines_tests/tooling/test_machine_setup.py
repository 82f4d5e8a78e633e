"""The test servers' one-time machine set-up is race-free: two processes that find no server
user at once (two pytest-xdist workers on a new machine) create it once, and each then starts a
PostgreSQL server of its own."""

from __future__ import annotations

import multiprocessing
import os
import pwd
import subprocess
import uuid

import psycopg
import pytest

from mostovik_pipelines_tests.support.machine import MachineNotReady, require_binary
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres

STARTERS = 2


def _start_a_server_as(user: str, barrier, results) -> None:
    barrier.wait()  # both find no such user, then race to set it up
    try:
        server = ThrowawayPostgres(server_user=user).start()
        try:
            with psycopg.connect(server.dsn()) as connection:
                results.put(connection.execute("SELECT 1").fetchone()[0])
        finally:
            server.stop()
    except Exception as error:
        results.put(f"{type(error).__name__}: {error} {getattr(error, 'stderr', '')}")


@pytest.mark.skipif(os.geteuid() != 0, reason="a non-root run needs no server user")
def test_two_processes_setting_up_a_new_machine_at_once_both_start_a_server():
    user = f"mostovik-pgt-{uuid.uuid4().hex[:8]}"
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(STARTERS), context.Queue()
    starters = [context.Process(target=_start_a_server_as, args=(user, barrier, results))
                for _ in range(STARTERS)]
    try:
        for starter in starters:
            starter.start()
        outcomes = [results.get(timeout=120) for _ in starters]
        for starter in starters:
            starter.join(timeout=30)
        assert outcomes == [1] * STARTERS
        assert pwd.getpwnam(user).pw_shell == "/usr/sbin/nologin"
    finally:
        subprocess.run(["userdel", user], capture_output=True)


def test_a_missing_server_binary_is_named_with_the_package_that_brings_it(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(MachineNotReady, match="install the Debian package no-such-server"):
        require_binary("no-such-server")
