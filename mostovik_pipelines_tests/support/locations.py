"""The code location wired for tests: a given warehouse, the stand-in, and a work directory.

Each source's resource is built from its declaration, not named here: an HTTP source is pointed
at its stand-in endpoint (discovered, :mod:`mostovik_pipelines.standin.endpoint`), a file source
gets an inbox and an archive under the work directory. A new source needs nothing here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dagster import ConfigurableResource, Definitions

from mostovik_pipelines.core.retries import RetryPolicy
from mostovik_pipelines.definitions import build_code_location
from mostovik_pipelines.framework.assets.resource_keys import source_resource_key
from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.resources import HttpSourceResource, LandingStoreResource, WarehouseResource
from mostovik_pipelines.resources.inbox import InboxResource
from mostovik_pipelines.resources.op_outputs import OpOutputStore
from mostovik_pipelines.standin import StandinServer

FAST_RETRY = RetryPolicy(max_attempts=3, base_delay_seconds=0.05, max_delay_seconds=0.2)
"""Short retry delays, so retry tests take seconds, not minutes (a store's outage budget is its
setting's, :mod:`mostovik_pipelines.core.outages`)."""


def code_location_for(warehouse_url: str, standin_server: StandinServer, work_dir: Path,
                      sources, **resources: Any) -> Definitions:
    """The code location of ``sources`` on ``warehouse_url`` and the stand-in, with landing and
    op outputs under ``work_dir``; ``resources`` replace any of these by key."""
    return build_code_location(
        sources=sources,
        resources={
            "warehouse": WarehouseResource(database_url=warehouse_url),
            "landing": LandingStoreResource(base_dir=str(work_dir / "landing")),
            "io_manager": OpOutputStore(base_dir=str(work_dir / "storage")),
            **{source_resource_key(spec): standin_resource(spec, standin_server, work_dir)
               for spec in sources if source_resource_key(spec) not in resources},
            **resources,
        },
    )


def standin_resource(spec: SourceSpec, standin_server: StandinServer,
                     work_dir: Path) -> ConfigurableResource:
    """The source's resource as declared, pointed at the stand-in: its endpoint's URL (short
    timeout, no token), or an inbox and archive under ``work_dir``."""
    if isinstance(spec.resource, InboxResource):
        return InboxResource(inbox_dir=str(work_dir / "inbox"),
                             archive_dir=str(work_dir / "archive"))
    if isinstance(spec.resource, HttpSourceResource):
        return HttpSourceResource(base_url=standin_server.endpoint_url(spec.name),
                                  timeout_seconds=2.0)
    raise TypeError(f"source {spec.name}: no stand-in wiring for a "
                    f"{type(spec.resource).__name__}; add it to {__name__}")
