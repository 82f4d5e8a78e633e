"""A throw-away Prometheus server (the Debian package ``prometheus``) scraping given targets on
127.0.0.1, and PromQL over its HTTP API, as a dashboard or an alert rule asks it."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Any

import httpx
import yaml

from mostovik_pipelines_tests.support.machine import require_binary
from mostovik_pipelines_tests.support.postgres import free_port
from mostovik_pipelines_tests.support.processes import stop_process
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until

SCRAPE_INTERVAL_SECONDS = 2
"""The tests' scrape interval and timeout (deploy/README's sample: 30 s and 20 s)."""


class ThrowawayPrometheus:
    """Prometheus with its data under ``work_dir``, scraping ``targets`` (job name ->
    ``host:port``) every :data:`SCRAPE_INTERVAL_SECONDS`; a context manager."""

    def __init__(self, work_dir: Path, targets: dict[str, str]) -> None:
        self.work_dir = work_dir
        self.targets = targets
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work_dir / "prometheus.log"
        self._process: subprocess.Popen | None = None
        self._http = httpx.Client(base_url=self.url, timeout=30)

    def __enter__(self) -> ThrowawayPrometheus:
        config = self.work_dir / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_SECONDS}s",
                       "scrape_timeout": f"{SCRAPE_INTERVAL_SECONDS}s"},
            "scrape_configs": [{"job_name": name, "static_configs": [{"targets": [target]}]}
                               for name, target in self.targets.items()],
        }))
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [require_binary("prometheus"), f"--config.file={config}",
                 f"--storage.tsdb.path={self.work_dir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        def ready() -> bool:
            if self._process.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{self.log()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                return self._http.get("/-/ready").status_code == 200
            return False

        try:
            wait_until(ready, PROCESS_START_MARGIN_SECONDS, "prometheus ready",
                       lambda: self.log()[-3000:])
        except AssertionError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._http.close()
        stop_process(self._process, 20)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector ``promql`` evaluates to now: ``{"metric": labels, "value":
        float}`` per series."""
        body = self._http.get("/api/v1/query", params={"query": promql}).json()
        if body.get("status") != "success":
            raise AssertionError(f"PromQL {promql!r} failed: {body}")
        return [{"metric": series["metric"], "value": float(series["value"][1])}
                for series in body["data"]["result"]]

    def metadata(self) -> dict[str, str]:
        """Each metric family's type as Prometheus read it from the exposition."""
        body = self._http.get("/api/v1/metadata").json()
        return {name: entries[0]["type"] for name, entries in body["data"].items()}

    def value(self, promql: str) -> float | None:
        """The one value ``promql`` gives now; ``None`` while there is none."""
        result = self.query(promql)
        if len(result) > 1:
            raise AssertionError(f"PromQL {promql!r} gave several series: {result}")
        return result[0]["value"] if result else None
