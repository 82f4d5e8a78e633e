"""The code location with the CBR source backfilled one run per day, for the tests' webserver and
daemon (``DagsterServices(code_location_module=__name__)``).

A UI backfill of the CBR source is one ranged run (its ``single_run`` policy); a multi-run policy
(the ERP sync's: a run per 31 days) splits a long backfill into many runs, which the daemon
launches one after another. One day per run gives a short backfill of many runs, so a test can
stop the daemon between two of them.
"""

from __future__ import annotations

import dataclasses

from dagster import BackfillPolicy

from mostovik_pipelines.definitions import build_code_location
from mostovik_pipelines.sources import cbr_daily_rates

defs = build_code_location(
    [
        dataclasses.replace(
            cbr_daily_rates.SOURCE,
            backfill_policy=BackfillPolicy.multi_run(max_partitions_per_run=1),
        )
    ]
)
