"""Prometheus metrics of the pipelines (``mostovik metrics --port N``): how late each source is,
what waits for an operator, how the jobs went, read from run storage and the warehouse.

Dagster OSS exports no metrics; this is a small process of its own, so a scrape never weighs on
the webserver or the daemon. Each scrape reads everything in one pass, and the figures are
cached for :data:`.collector.CACHE_SECONDS`: several Prometheus servers, or a fast scrape
interval, cost one pass per cache period. The names and their meaning: deploy/README.md,
"Metrics".
"""
