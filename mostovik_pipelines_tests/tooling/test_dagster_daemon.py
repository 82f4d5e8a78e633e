"""The tests' ``dagster-daemon`` (support/dagster_daemon.py) sets the backfill daemon's pass
interval through a private name of Dagster's: pinned here, so a Dagster upgrade that moves it
fails this test instead of silently making every backfill test wait 30 s a pass."""

from __future__ import annotations

import logging
from unittest import mock

from dagster._daemon import backfill, controller

from mostovik_pipelines_tests.support.dagster_daemon import (
    BACKFILL_INTERVAL_SECONDS,
    configure_backfill_interval,
)


def test_the_backfill_loop_waits_the_configured_interval_between_passes():
    waits = []
    shutdown = mock.Mock()
    shutdown.wait.side_effect = waits.append
    original = controller.DEFAULT_DAEMON_INTERVAL_SECONDS
    try:
        configure_backfill_interval()
        with mock.patch.object(backfill, "execute_backfill_iteration", return_value=iter(())):
            loop = backfill.execute_backfill_iteration_loop(
                mock.Mock(), logging.getLogger("test"), shutdown)
            while not waits:
                next(loop)
    finally:
        controller.DEFAULT_DAEMON_INTERVAL_SECONDS = original
    assert original == 30
    assert BACKFILL_INTERVAL_SECONDS - 1 < waits[0] <= BACKFILL_INTERVAL_SECONDS
