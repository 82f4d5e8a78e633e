"""``mostovik metrics``: the Prometheus exposition, served until the process is stopped."""

from __future__ import annotations

import contextlib
import signal
import threading

import click


@click.command("metrics")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", required=True, type=int, help="e.g. MOSTOVIK_METRICS_PORT.")
@click.option("--cache-seconds", default=None, type=float,
              help="Answer scrapes from the last pass for this long (default 30).")
def metrics(host: str, port: int, cache_seconds: float | None) -> None:
    """Serve /metrics for Prometheus: per source lateness, failed and waiting partitions, jobs
    and rows over the last day, load duration, run queue depth, last prune's bytes. Reads the
    instance of DAGSTER_HOME and the warehouse of MOSTOVIK_DATABASE_URL."""
    from dagster import DagsterInstance
    from prometheus_client import CollectorRegistry, start_http_server

    from mostovik_pipelines.core.settings import resolved_database_url
    from mostovik_pipelines.metrics.collector import CACHE_SECONDS, PipelineCollector
    from mostovik_pipelines.sources import ALL_SOURCES

    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    with DagsterInstance.get() as instance:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(PipelineCollector(
            instance, resolved_database_url(), ALL_SOURCES,
            cache_seconds=CACHE_SECONDS if cache_seconds is None else cache_seconds))
        server, thread = start_http_server(port, addr=host, registry=registry)
        click.echo(f"metrics on http://{host}:{port}/metrics")
        with contextlib.suppress(KeyboardInterrupt):
            stopped.wait()
        server.shutdown()
        thread.join()
