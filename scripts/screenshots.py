"""Screenshots of the Dagster UI on the demo data (``make screenshots``, after ``mostovik demo``).

Starts ``dagster-webserver`` on 127.0.0.1 against this directory's instance (DAGSTER_HOME, the
SQLite storage the demo filled) and drives headless Chromium (the Debian package ``chromium``)
through its DevTools protocol, as an operator would click: the plots of the asset's metadata
are behind a toggle, the asset graph's groups are expanded. One PNG per page goes to
``docs/screenshots/``. Only the webserver runs, no daemon: no schedule fires against the real
sources while the pictures are taken.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from websockets.sync.client import connect  # comes with dagster-webserver (uvicorn[standard])

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LOCATION = "mostovik_pipelines"
ASSET = "cbr_daily_rates"
WIDTH, HEIGHT = 1600, 1000
GRAPH_HEIGHT = 1800
"""The asset graph stacks its groups: a taller page shows them all."""
SETTLE_SECONDS = 2.5
"""After the awaited text shows: charts and the graph's layout finish drawing."""

LOCATIONS_QUERY = """
  query Locations {
    locationStatusesOrError {
      ... on WorkspaceLocationStatusEntries { entries { name loadStatus } }
    }
  }
"""
LATEST_LOAD_QUERY = """
  query LatestLoad($assetKey: AssetKeyInput!) {
    assetNodeOrError(assetKey: $assetKey) {
      ... on AssetNode {
        assetMaterializations(limit: 1) { runId partition }
        assetChecksOrError { ... on AssetChecks { checks { name } } }
      }
    }
  }
"""
GROUPS_QUERY = """
  query Groups { assetNodes { groupName } }
"""
NUX_SEEN_MUTATION = "mutation NuxSeen { setNuxSeen }"
"""The "Skip" button of the UI's first-visit dialog (recorded under DAGSTER_HOME/.nux)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "screenshots")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("headless Chromium is needed: apt-get install -y chromium", file=sys.stderr)
        return 2
    if not os.environ.get("DAGSTER_HOME"):
        print("DAGSTER_HOME is not set: run through `make screenshots`", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{_free_port()}"
    with tempfile.TemporaryDirectory() as work, _webserver(url, Path(work)) as webserver:
        _wait_until_loaded(url, webserver)
        _graphql(url, NUX_SEEN_MUTATION)
        load = _graphql(url, LATEST_LOAD_QUERY, {"assetKey": {"path": [ASSET]}})[
            "assetNodeOrError"]
        if not load["assetMaterializations"]:
            raise SystemExit(f"{ASSET} was never loaded: run `mostovik demo` first")
        run_id = load["assetMaterializations"][0]["runId"]
        partition = load["assetMaterializations"][0]["partition"]
        groups = sorted({node["groupName"] for node in _graphql(url, GROUPS_QUERY)["assetNodes"]})
        with _Browser(chromium, Path(work) / "profile") as browser:
            browser.open(f"{url}/asset-groups", groups[0])
            # The graph remembers its expanded groups: expand all, then load it again.
            expanded = ",".join(f"global@global:{group}" for group in groups)
            browser.evaluate("localStorage.setItem('asset-graph-open-graph-nodes-global-__GLOBAL__'"
                             f", JSON.stringify({{expanded: {json.dumps(expanded)}}}))")
            browser.resize(WIDTH, GRAPH_HEIGHT)
            browser.open(f"{url}/asset-groups", ASSET)
            browser.save(args.out / "asset-graph.png")
            browser.resize(WIDTH, HEIGHT)

            browser.open(f"{url}/assets/{ASSET}", "Columns")
            browser.save(args.out / "asset.png")

            browser.open(f"{url}/assets/{ASSET}?view=partitions&partition={partition}",
                         "payload_bytes")
            browser.save(args.out / "partitions.png")

            browser.open(f"{url}/assets/{ASSET}", "Metadata")
            browser.click("Plots")
            browser.scroll_to("Metadata")
            browser.save(args.out / "plots.png")

            checks = [check["name"] for check in load["assetChecksOrError"]["checks"]]
            browser.open(f"{url}/assets/{ASSET}?view=checks", checks[0])
            browser.click("Partitions", last=True)
            browser.save(args.out / "checks.png")

            browser.open(f"{url}/runs", "mostovik/status")
            browser.save(args.out / "run-list.png")

            browser.open(f"{url}/runs/{run_id}", "RUN_SUCCESS")
            browser.save(args.out / "run.png")
            browser.click("View tags and config")
            browser.save(args.out / "run-tags.png")
    for png in sorted(args.out.glob("*.png")):
        print(png)
    return 0


@contextlib.contextmanager
def _webserver(url: str, work: Path):
    port = url.rsplit(":", 1)[1]
    with (work / "webserver.log").open("wb") as log:
        process = subprocess.Popen(
            [str(BIN / "dagster-webserver"), "-h", "127.0.0.1", "-p", port,
             "-w", str(REPO / "workspace.yaml")],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            yield process
        finally:
            _stop(process)


class _Browser:
    """Headless Chromium, one page, driven through the DevTools protocol."""

    def __init__(self, chromium: str, profile: Path) -> None:
        self.port = _free_port()
        self.process = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run", f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}",
             f"--remote-debugging-port={self.port}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self._ids = itertools.count(1)
        self._open = contextlib.ExitStack()

    def __enter__(self) -> _Browser:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                pages = [target for target in httpx.get(
                    f"http://127.0.0.1:{self.port}/json/list").json()
                         if target["type"] == "page"]
                if pages:
                    break
            if time.monotonic() > deadline:
                _stop(self.process)
                raise SystemExit("headless Chromium did not start")
            time.sleep(0.2)
        self._socket = self._open.enter_context(
            connect(pages[0]["webSocketDebuggerUrl"], max_size=None))
        self.resize(WIDTH, HEIGHT)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._open.close()
        _stop(self.process)

    def send(self, method: str, **params: object) -> dict:
        message_id = next(self._ids)
        self._socket.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            message = json.loads(self._socket.recv())
            if message.get("id") == message_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, expression: str) -> object:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def resize(self, width: int, height: int) -> None:
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def open(self, url: str, text: str, timeout: float = 60) -> None:
        """Go to ``url`` and wait until the page shows ``text``."""
        self.send("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while not self.evaluate(f"!!document.body && document.body.innerText.includes("
                                f"{json.dumps(text)})"):
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not show {text!r} in {timeout:.0f} s")
            time.sleep(0.3)
        time.sleep(SETTLE_SECONDS)

    def click(self, label: str, last: bool = False) -> None:
        """Click the (first, or last) button or tab labelled ``label``."""
        found = self.evaluate(f"""(() => {{
            const all = [...document.querySelectorAll('button, a, [role=tab]')]
                .filter(e => e.innerText.trim() === {json.dumps(label)});
            const target = {'all[all.length - 1]' if last else 'all[0]'};
            if (target) target.click();
            return !!target;
        }})()""")
        if not found:
            raise SystemExit(f"no {label!r} to click")
        time.sleep(SETTLE_SECONDS)

    def scroll_to(self, heading: str) -> None:
        self.evaluate(f"""[...document.querySelectorAll('div, span, h1, h2, h3')]
            .find(e => e.children.length === 0 && e.innerText.trim() === {json.dumps(heading)})
            ?.scrollIntoView({{block: 'start'}})""")
        time.sleep(SETTLE_SECONDS)

    def save(self, target: Path) -> None:
        data = self.send("Page.captureScreenshot", format="png")["data"]
        target.write_bytes(base64.b64decode(data))


def _graphql(url: str, query: str, variables: dict | None = None) -> dict:
    response = httpx.post(f"{url}/graphql", json={"query": query, "variables": variables or {}},
                          timeout=60)
    response.raise_for_status()
    return response.json()["data"]


def _wait_until_loaded(url: str, webserver: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if webserver.poll() is not None:
            raise SystemExit(f"dagster-webserver exited with {webserver.returncode}")
        with contextlib.suppress(httpx.HTTPError, KeyError, TypeError):
            entries = _graphql(url, LOCATIONS_QUERY)["locationStatusesOrError"]["entries"]
            if {e["name"]: e["loadStatus"] for e in entries}.get(LOCATION) == "LOADED":
                return
        time.sleep(1)
    raise SystemExit(f"code location {LOCATION} not loaded after {timeout:.0f} s")


def _stop(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
