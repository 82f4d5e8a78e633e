"""The code location wired for tests: a given warehouse, the stand-in, and a work directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dagster import Definitions, FilesystemIOManager

from mostovik_pipelines.definitions import build_code_location
from mostovik_pipelines.etl.retries import RetryPolicy
from mostovik_pipelines.resources import HttpSourceResource, LandingStoreResource, WarehouseResource
from mostovik_pipelines.resources.inbox import InboxResource
from mostovik_pipelines.standin import StandinServer

FAST_RETRY = RetryPolicy(max_attempts=3, base_delay_seconds=0.05, max_delay_seconds=0.2)
"""Short retry delays, so retry tests take seconds, not minutes."""


def code_location_for(warehouse_url: str, standin_server: StandinServer, work_dir: Path,
                      sources, **resources: Any) -> Definitions:
    """The code location of ``sources`` on ``warehouse_url`` and the stand-in, with landing and
    op outputs under ``work_dir``; ``resources`` replace any of these by key."""
    return build_code_location(
        sources=sources,
        resources={
            "warehouse": WarehouseResource(database_url=warehouse_url),
            "landing": LandingStoreResource(base_dir=str(work_dir / "landing")),
            "io_manager": FilesystemIOManager(base_dir=str(work_dir / "storage")),
            "cbr_daily_rates_source": HttpSourceResource(
                base_url=standin_server.cbr_url, timeout_seconds=2.0
            ),
            "erp_work_orders_source": HttpSourceResource(
                base_url=standin_server.erp_url, timeout_seconds=2.0
            ),
            "material_deliveries_source": InboxResource(
                inbox_dir=str(work_dir / "inbox"), archive_dir=str(work_dir / "archive")
            ),
            **resources,
        },
    )
