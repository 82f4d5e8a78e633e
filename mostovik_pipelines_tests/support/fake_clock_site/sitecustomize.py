"""``time.sleep`` that works under libfaketime, for the processes the tests run on a fake clock.

:mod:`mostovik_pipelines_tests.support.fake_clock` puts this folder first on the ``PYTHONPATH``
of the processes it preloads libfaketime into (the daemon, and through it its code server and
run workers); Python imports ``sitecustomize`` at start-up. Debian's libfaketime 0.9.10 breaks
Python's waits either way: with the monotonic clock faked, timed waits (``Event.wait``, lock
timeouts) never return; with it left alone (``FAKETIME_DONT_FAKE_MONOTONIC=1``, as we run it),
those work but every ``time.sleep`` fails with EINVAL (libfaketime issues #390, #426: Python
sleeps with an absolute ``clock_nanosleep`` the library mistranslates). So ``time.sleep`` waits
in ``select`` instead, which the library leaves alone, until its monotonic deadline.

It does nothing in a process without libfaketime. Being first on the path, it hides the
system's own ``sitecustomize`` (Debian's only installs the apport crash hook) in the processes
it is given to.
"""

import os

if os.environ.get("FAKETIME") and "faketime" in os.environ.get("LD_PRELOAD", ""):
    import select
    import time

    def _sleep(seconds: float) -> None:
        """``time.sleep(seconds)`` on the real monotonic clock."""
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        deadline = time.monotonic() + seconds
        remaining = float(seconds)
        while True:
            select.select([], [], [], remaining)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return

    time.sleep = _sleep
