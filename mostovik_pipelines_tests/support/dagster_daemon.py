"""``dagster-daemon`` for tests, with the backfill daemon's pass interval configured.

Dagster's backfill daemon looks at its backfills every 30 s, a constant of its controller that
no setting reaches (``dagster._daemon.controller.DEFAULT_DAEMON_INTERVAL_SECONDS``, read by
``execute_backfill_iteration_loop`` each pass). A backfill needs two passes or more (one launches
its runs, a later one marks it done), so every test of a backfill waited a minute or more on
that clock alone. This entry point is the real daemon with the interval set to
:data:`BACKFILL_INTERVAL_SECONDS`; it is the tests' one use of that private name, and
``test_dagster_daemon.py`` pins that the backfill loop still reads it.

Run as ``python .../support/dagster_daemon.py run --workspace ...`` (a script: it imports
nothing of the tests), or as ``python -m mostovik_pipelines_tests.support.dagster_daemon ...``
(the fake-clock daemon: no test module shadows a standard one then), with the arguments of
``dagster-daemon``.
"""

from __future__ import annotations

import sys

BACKFILL_INTERVAL_SECONDS = 2.0
"""The tests' backfill daemon pass interval (Dagster's own: 30 s)."""


def configure_backfill_interval(seconds: float = BACKFILL_INTERVAL_SECONDS) -> None:
    """Every backfill daemon loop started after this call passes every ``seconds``."""
    from dagster._daemon import controller

    controller.DEFAULT_DAEMON_INTERVAL_SECONDS = seconds


def main() -> None:
    from dagster._daemon.cli import main as daemon_main

    configure_backfill_interval()
    sys.argv[0] = "dagster-daemon"
    sys.exit(daemon_main())


if __name__ == "__main__":
    main()
