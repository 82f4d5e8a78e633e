"""deploy/README.md run as written: every command of its ``sh`` blocks, in the runbook's order, on
a machine that is a directory of its own (:mod:`.support.systemd_units`: the runbook's
``/opt/mostovik``, ``/var/lib/mostovik``, ``/etc/mostovik`` and ``/etc/systemd/system`` under it),
as root, with the services run as the user ``mostovik`` their units name.

Install (a clone, a new venv, the env file filled in for this machine: its PostgreSQL, Redis, an S3
API server for every store, the stand-in for the sources), migrate and create the buckets, start
every unit by its ``ExecStart`` with the env file's settings (``systemctl`` is the test's, which
starts a unit as systemd would), check the workers and the UI; then, through the UI's GraphQL, a
backfill; deploy a release of new code (committed to the clone's origin) and see it in the UI;
prune; read the metrics; lose the run storage and rebuild the tracker; drain a worker. A block the
test did not run fails it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from mostovik_pipelines_tests.support.doc_commands import FENCE, REPO, _joined
from mostovik_pipelines_tests.support.graphql import DagsterGraphQL
from mostovik_pipelines_tests.support.object_store import S3ApiServer, why_no_s3_api
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres, free_port
from mostovik_pipelines_tests.support.redis import ThrowawayRedis
from mostovik_pipelines_tests.support.systemd_units import (
    SYSTEMD_PATH,
    Unit,
    install_systemctl,
    on_machine,
    read_environment_file,
)
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until
from mostovik_pipelines_tests.support.warehouse import table_rows
from mostovik_pipelines_tests.support.webhook import WebhookReceiver

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

DOCUMENT = "deploy/README.md"
PYTHON = "/usr/bin/python3.11"
SERVICE_USER = "mostovik"
ASSET = "cbr_daily_rates"
BACKFILL = ["2026-11-02", "2026-11-03"]
AFTER_DEPLOY = "2026-11-04"
RELEASE_MARK = "(release 2)"
SESSION = "set -a; . /etc/mostovik/mostovik.env"
"""How the runbook's operator session starts: every block after the install runs in one."""
INSTALL_SECONDS = 900


def shown_blocks(document: str = DOCUMENT) -> list[list[str]]:
    """The command lines of each ``sh`` block of ``document``, in order."""
    return [[line.strip() for line in _joined(match.group(2).splitlines()) if line.strip()]
            for match in FENCE.finditer((REPO / document).read_text(encoding="utf-8"))
            if match.group(1) == "sh"]


class Machine:
    """The machine the runbook installs: a root directory, and a root shell on it."""

    def __init__(self, root: Path, origin: Path) -> None:
        self.root = root
        self.origin = origin
        self.blocks = shown_blocks()
        self.ran: set[int] = set()
        bin_dir = root / "test-bin"
        install_systemctl(bin_dir, root)
        passed = {k: v for k, v in os.environ.items()
                  if k.startswith(("PIP_", "SSL_", "REQUESTS_CA")) or k.lower().endswith("_proxy")}
        self.shell_environment = {**passed, "PATH": f"{bin_dir}:{SYSTEMD_PATH}",
                                  "HOME": "/root", "LANG": "C.UTF-8"}
        (session,) = [line for block in self.blocks for line in block
                      if line.startswith(SESSION)]
        self.session = on_machine(session, root)
        # What any Debian machine has, and the runbook takes for granted.
        (root / "etc" / "systemd" / "system").mkdir(parents=True)

    def run(self, starts_with: str, session: bool = True, timeout: float = 600
            ) -> subprocess.CompletedProcess:
        """Type the block that starts with ``starts_with`` into a root shell (after the
        session's first line, unless it is the block's own); its output, once it exited 0."""
        (index,) = [i for i, block in enumerate(self.blocks) if block[0].startswith(starts_with)]
        lines = self.blocks[index]
        # The user's home is only recorded (the machine's paths are not this directory's).
        script = "\n".join(line if line.startswith("id -u ") else on_machine(line, self.root)
                           for line in lines).replace("<repo>", str(self.origin))
        if session and not lines[0].startswith(SESSION):
            script = f"{self.session}\n{script}"
        started = time.monotonic()
        typed = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd="/",
                               env=self.shell_environment, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=timeout)
        shown = [line for line in typed.stdout.splitlines() if "WARNING: Location" not in line]
        print(f"\n{DOCUMENT}, block {index + 1} of {len(self.blocks)} ({len(lines)} commands, "
              f"exit {typed.returncode}, {time.monotonic() - started:.0f} s):\n  $ "
              + "\n  $ ".join(lines) + "\n  " + "\n  ".join(shown[-6:]))
        assert typed.returncode == 0, (f"{DOCUMENT}: the block starting `{lines[0]}` exited "
                                       f"{typed.returncode}:\n{typed.stdout[-5000:]}")
        self.ran.add(index)
        return typed

    def path(self, path: str) -> Path:
        return Path(on_machine(path, self.root))

    def environment(self) -> dict[str, str]:
        return read_environment_file(self.path("/etc/mostovik/mostovik.env"))

    def fill_in(self, values: dict[str, str]) -> None:
        """What an operator does after installing the env file: every placeholder replaced with
        this machine's values, the commented ``AWS_*`` lines given theirs; the rest kept."""
        env_file = self.path("/etc/mostovik/mostovik.env")
        lines, given = [], set()
        for line in env_file.read_text().splitlines():
            key = line.split("=", 1)[0].strip()
            if "=" in line and not line.lstrip().startswith("#"):
                value = values[key] if key in values else on_machine(line.split("=", 1)[1],
                                                                      self.root)
                given.add(key)
                line = f"{key}={value}"
            lines.append(line)
        lines += [f"{key}={value}" for key, value in values.items() if key not in given]
        env_file.write_text("\n".join(lines) + "\n")
        left = [line for line in lines if not line.lstrip().startswith("#")
                and ("change-me" in line or ".internal" in line)]
        assert not left, f"placeholders left in the env file: {left}"

    def stop_everything(self) -> None:
        for pid_file in (self.root / "run" / "mostovik").glob("*.pid"):
            with contextlib.suppress(Exception):
                Unit(self.root, pid_file.name.removesuffix(".pid")).stop()

    def log(self, unit: str) -> str:
        path = self.root / "var" / "log" / "mostovik" / f"{unit}.service.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"


@pytest.fixture(scope="module")
def machine(postgres: ThrowawayPostgres, standin_server,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Machine, dict]]:
    if os.geteuid() != 0:
        pytest.skip("the runbook installs as root and runs the services as the user mostovik")
    if not Path(PYTHON).exists() or shutil.which("git") is None or shutil.which("curl") is None:
        pytest.skip(f"the runbook needs {PYTHON}, git and curl")
    if reason := why_no_s3_api():
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="mostovik-runbook-", dir="/tmp"))
    root.chmod(0o755)  # the service user reaches its directories through it
    origin = _origin(root / "origin")
    databases = ("dagster_runbook", "warehouse_runbook")
    with psycopg.connect(postgres.dsn(), autocommit=True) as connection:
        for database in databases:
            connection.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
            connection.execute(f"CREATE DATABASE {database}")
    redis = ThrowawayRedis().start()
    store = S3ApiServer().start()
    webhook = WebhookReceiver().__enter__()
    on = Machine(root, origin)
    ports = {name: str(free_port()) for name in ("code_server", "webserver", "metrics")}
    values = {
        "MOSTOVIK_DAGSTER_PG_USER": "mostovik", "MOSTOVIK_DAGSTER_PG_PASSWORD": postgres.password,
        "MOSTOVIK_DAGSTER_PG_HOST": "127.0.0.1", "MOSTOVIK_DAGSTER_PG_PORT": str(postgres.port),
        "MOSTOVIK_DAGSTER_PG_DB": databases[0],
        "MOSTOVIK_CODE_SERVER_PORT": ports["code_server"],
        "MOSTOVIK_WEBSERVER_PORT": ports["webserver"], "MOSTOVIK_METRICS_PORT": ports["metrics"],
        "MOSTOVIK_CELERY_BROKER_URL": redis.url(0), "MOSTOVIK_CELERY_BACKEND_URL": redis.url(1),
        "MOSTOVIK_DATABASE_URL": postgres.url(databases[1]),
        "MOSTOVIK_LANDING_DIR": "s3://mostovik-landing/prod",
        "MOSTOVIK_STORAGE_DIR": "s3://mostovik-outputs/prod",
        "MOSTOVIK_INBOX_DIR": "s3://mostovik-inbox/in",
        "MOSTOVIK_ARCHIVE_DIR": "s3://mostovik-inbox/archive",
        **store.environment,
        "MOSTOVIK_CBR_URL": standin_server.cbr_url,
        "MOSTOVIK_CBR_METALS_URL": standin_server.endpoint_url("cbr_metal_prices"),
        "MOSTOVIK_ERP_URL": standin_server.erp_url, "MOSTOVIK_ERP_TOKEN": "runbook-token",
        "MOSTOVIK_ALERT_WEBHOOK_URL": webhook.url,
        "MOSTOVIK_UI_URL": f"http://127.0.0.1:{ports['webserver']}",
    }
    try:
        yield on, values
    finally:
        on.stop_everything()
        webhook.__exit__(None, None, None)
        store.close()
        redis.stop()
        with psycopg.connect(postgres.dsn(), autocommit=True) as connection:
            for database in databases:
                connection.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        shutil.rmtree(root, ignore_errors=True)


def _origin(origin: Path) -> Path:
    """Where the machine clones from: this repository as it is now (its committed history, and
    its working tree's changes committed on top), so the runbook installs the code under test."""
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(origin)], check=True)
    changed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--modified", "--others", "--deleted",
         "--exclude-standard"], check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, changed):
        source, target = REPO / name, origin / name
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        else:
            target.unlink(missing_ok=True)
    _commit(origin, "The working tree")
    return origin


def _commit(origin: Path, message: str) -> None:
    subprocess.run(["git", "-C", str(origin), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(origin), "-c", "user.name=runbook", "-c",
                    "user.email=runbook@example.invalid", "commit", "--quiet", "--allow-empty",
                    "-m", message], check=True)


def _service_user_runs(machine: Machine, unit: str) -> bool:
    pid = Unit(machine.root, unit).pid()
    status = Path(f"/proc/{pid}/status").read_text()
    uid = int(re.search(r"^Uid:\s+(\d+)", status, re.MULTILINE).group(1))
    return uid == pwd.getpwnam(SERVICE_USER).pw_uid


def _release(origin: Path) -> None:
    """A release of new code, committed where the machine pulls from: the CBR asset's
    description says which release it is."""
    source = origin / "mostovik_pipelines" / "sources" / "cbr_daily_rates" / "source.py"
    text = source.read_text()
    assert "exchange rates of the rouble," in text
    source.write_text(text.replace("exchange rates of the rouble,",
                                   f"exchange rates of the rouble {RELEASE_MARK},", 1))
    _commit(origin, "Release 2")


def test_the_runbook_as_written_installs_starts_deploys_prunes_and_measures(machine):
    on, values = machine

    # Install, then fill the env file in.
    on.run("id -u mostovik", session=False, timeout=INSTALL_SECONDS)
    assert on.path("/opt/mostovik/venv/bin/mostovik").exists()
    assert (on.path("/var/lib/mostovik/dagster_home").stat().st_uid
            == pwd.getpwnam(SERVICE_USER).pw_uid)
    assert oct(on.path("/etc/mostovik/mostovik.env").stat().st_mode & 0o777) == "0o600"
    on.fill_in(values)

    # Migrate, and the stores made and written once.
    migrated = on.run(SESSION).stdout
    assert "warehouse at revision" in migrated, migrated
    assert "created bucket mostovik-landing" in migrated, migrated
    assert "FAILED" not in migrated, migrated

    # Start every unit; the workers answer, the UI answers.
    on.run("systemctl enable --now mostovik-code-server")
    units = ("mostovik-code-server", "mostovik-daemon", "mostovik-webserver",
             "mostovik-metrics", "mostovik-worker@worker-a", "mostovik-worker@worker-b")
    graphql = DagsterGraphQL(f"http://127.0.0.1:{values['MOSTOVIK_WEBSERVER_PORT']}/graphql")

    def location_loaded() -> bool:
        # Started together, the webserver may reach the code server before it serves: the UI
        # shows the location's error until the code server's start event refreshes it.
        with contextlib.suppress(Exception):
            return (graphql.location_statuses().get("mostovik_pipelines") == "LOADED"
                    and graphql.location_load_error() is None)
        return False

    wait_until(location_loaded, 3 * PROCESS_START_MARGIN_SECONDS, "the UI serving the location",
               lambda: "\n".join(on.log(u) for u in units[:3]))
    for unit in units:
        assert Unit(on.root, unit).running(), on.log(unit)
        assert _service_user_runs(on, unit), f"{unit} does not run as {SERVICE_USER}"
    # The units' ports are bound to 127.0.0.1 only.
    def bound() -> dict[str, list[str]] | None:
        listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
        found = {setting: [line.split()[3] for line in listening.splitlines()
                           if line.split()[3].rsplit(":", 1)[1] == values[setting]]
                 for setting in ("MOSTOVIK_CODE_SERVER_PORT", "MOSTOVIK_WEBSERVER_PORT",
                                 "MOSTOVIK_METRICS_PORT")}
        return found if all(found.values()) else None

    for setting, addresses in wait_until(bound, PROCESS_START_MARGIN_SECONDS,
                                         "every unit's port listening").items():
        # (gRPC listens on the IPv4-mapped form of the same loopback address.)
        assert all(address.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:"))
                   for address in addresses), (setting, addresses)
    pinged = wait_until(lambda: (lambda out: out if out.count("pong") >= 2 else None)(
        subprocess.run(["bash", "-c", f"{on.session}\nmostovik-celery inspect ping"],
                       env=on.shell_environment, capture_output=True, text=True).stdout),
        PROCESS_START_MARGIN_SECONDS, "both workers answering")
    assert "worker-a@" in pinged and "worker-b@" in pinged
    checked = on.run("mostovik-celery inspect ping").stdout
    assert checked.count("pong") == 2, checked

    def daemons_healthy() -> bool:
        statuses = graphql.daemon_statuses()
        return bool(statuses) and all(s["healthy"] for s in statuses.values() if s["required"])

    wait_until(daemons_healthy, 3 * PROCESS_START_MARGIN_SECONDS, "every daemon healthy",
               lambda: on.log("mostovik-daemon"))

    # A backfill from the UI: its runs on the workers, the dates in the warehouse.
    backfill = graphql.launch_partition_backfill([ASSET], BACKFILL)
    assert graphql.wait_for_backfill(backfill).status == "COMPLETED_SUCCESS", (
        on.log("mostovik-daemon"))
    rows = table_rows(values["MOSTOVIK_DATABASE_URL"], ASSET)
    assert {str(row["partition_date"]) for row in rows} == set(BACKFILL)

    # Deploy new code: the UI shows it; a run launched after it succeeds.
    assert RELEASE_MARK not in graphql.asset_node(ASSET)["description"]
    _release(on.origin)
    on.run("git -C /opt/mostovik/app pull")
    assert RELEASE_MARK in graphql.asset_node(ASSET)["description"]
    for unit in units:
        assert Unit(on.root, unit).running(), on.log(unit)
    run_id = graphql.launch_job_run(f"{ASSET}_job", AFTER_DEPLOY)
    assert graphql.wait_for_run(run_id).status == "SUCCESS", graphql.run_errors(run_id)

    # Prune now: the dry run, then the prune.
    pruned = on.run("runuser -u mostovik -- mostovik prune --dry-run").stdout
    assert "op outputs" in pruned, pruned

    # The metrics the unit serves count the jobs.
    measured = on.run("curl -sf http://127.0.0.1:$MOSTOVIK_METRICS_PORT/metrics").stdout
    completed = re.search(r'mostovik_runs_total\{source="cbr_daily_rates",'
                          r'status="completed"\} (\S+)', measured)
    assert completed and float(completed.group(1)) >= 2, measured

    # Run storage lost: the daemon stopped, the instance's database empty again, the tracker
    # rebuilt from the warehouse's ledger, the daemon started.
    Unit(on.root, "mostovik-daemon").stop()
    with psycopg.connect(values["MOSTOVIK_DATABASE_URL"].replace("+psycopg", ""),
                         autocommit=True) as connection:
        dagster_db = values["MOSTOVIK_DAGSTER_PG_DB"]
        connection.execute(f"DROP DATABASE {dagster_db} WITH (FORCE)")
        connection.execute(f"CREATE DATABASE {dagster_db}")
    rebuilt = on.run("mostovik tracker rebuild --dry-run").stdout
    assert "launched by the ledger" in rebuilt or "completed" in rebuilt, rebuilt
    Unit(on.root, "mostovik-daemon").start()
    wait_until(daemons_healthy, 3 * PROCESS_START_MARGIN_SECONDS, "every daemon healthy again",
               lambda: on.log("mostovik-daemon"))

    # Drain a worker, then stop it.
    on.run("mostovik-celery control cancel_consumer")
    assert not Unit(on.root, "mostovik-worker@worker-a").running()

    assert on.ran == set(range(len(on.blocks))), (
        "blocks of deploy/README.md no test runs: "
        f"{[on.blocks[i][0] for i in range(len(on.blocks)) if i not in on.ran]}")
