"""deploy/systemd's units started as systemd starts them, without systemd, for the runbook test.

A machine is a directory (``MOSTOVIK_TEST_ROOT``): the absolute paths the runbook and the units
name (:data:`MACHINE_PATHS`: ``/opt/mostovik``, ``/var/lib/mostovik``, ``/etc/mostovik``,
``/etc/systemd/system``, ``/mnt/mostovik-shared``) are read under it (:func:`on_machine`).

``python -m mostovik_pipelines_tests.support.systemd_units ARGS`` is the ``systemctl`` the runbook
types (:func:`install_systemctl` puts one on a ``PATH``), for what the runbook asks of it:
``daemon-reload``; ``enable --now``, ``start``, ``stop`` and ``restart`` of units. A unit is read
from ``/etc/systemd/system`` as systemd reads its ``[Service]``: the environment starts from
systemd's own (``PATH``), then ``Environment=`` lines, then ``EnvironmentFile=`` (which overrides
them); ``User=`` (the process runs as that user when this runs as root), ``WorkingDirectory=``;
``ExecStart=`` with ``\\`` continuations, the specifiers ``%i``, ``%n`` and ``%%``, and
``${NAME}`` replaced from that environment. The command starts in a session of its own, its
output in ``/var/log/mostovik/<unit>.log`` and its process id in ``/run/mostovik/<unit>.pid``
under the machine. ``stop`` does what ``KillMode=mixed`` does: SIGTERM to the main process,
SIGKILL to every process of the unit once it has ended or after ``TimeoutStopSec`` (here at most
:data:`STOP_SECONDS_CAP`).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

MACHINE_PATHS = ("/opt/mostovik", "/var/lib/mostovik", "/etc/mostovik", "/etc/systemd/system",
                 "/mnt/mostovik-shared")
ROOT_ENV = "MOSTOVIK_TEST_ROOT"
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STOP_SECONDS_CAP = 120.0
_MACHINE_PATH = re.compile("|".join(re.escape(path) for path in MACHINE_PATHS))


def on_machine(text: str, root: Path | str) -> str:
    """``text`` with every machine path read under ``root``."""
    return _MACHINE_PATH.sub(lambda match: f"{root}{match.group()}", text)


def install_systemctl(bin_dir: Path, root: Path) -> None:
    """A ``systemctl`` in ``bin_dir`` that runs this module for the machine at ``root``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    repo = Path(__file__).resolve().parents[2]
    script = bin_dir / "systemctl"
    script.write_text(f"#!/bin/sh\nexport {ROOT_ENV}={shlex.quote(str(root))}\n"
                      f"export PYTHONPATH={shlex.quote(str(repo))}\n"
                      f"exec {shlex.quote(sys.executable)} -m {__name__} \"$@\"\n")
    script.chmod(0o755)


class Unit:
    """One unit (``name`` as systemctl is given it) on the machine at ``root``."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = root
        self.name = name if "." in name else f"{name}.service"
        base, _, rest = self.name.partition("@")
        self.instance = rest.rsplit(".", 1)[0] if rest else ""
        file_name = f"{base}@.service" if rest else self.name
        self.file = Path(on_machine(f"/etc/systemd/system/{file_name}", root))
        self.pid_file = root / "run" / "mostovik" / f"{self.name}.pid"
        self.log_file = root / "var" / "log" / "mostovik" / f"{self.name}.log"

    def service(self) -> dict[str, list[str]]:
        """The ``[Service]`` section's settings, each with its values in order."""
        settings: dict[str, list[str]] = {}
        section = ""
        text = re.sub(r"\\\n\s*", " ", self.file.read_text())
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = line
                continue
            if section == "[Service]" and "=" in line:
                key, value = line.split("=", 1)
                settings.setdefault(key.strip(), []).append(on_machine(value.strip(), self.root))
        return settings

    def environment(self, settings: dict[str, list[str]]) -> dict[str, str]:
        environment = {"PATH": SYSTEMD_PATH, "LANG": "C.UTF-8"}
        for assignment in settings.get("Environment", []):
            for word in shlex.split(assignment):
                key, _, value = word.partition("=")
                environment[key] = value
        for path in settings.get("EnvironmentFile", []):
            environment.update(read_environment_file(Path(path.lstrip("-"))))
        return environment

    def command(self, settings: dict[str, list[str]], environment: dict[str, str]) -> list[str]:
        (line,) = settings["ExecStart"]
        line = self._specifiers(line)
        return [re.sub(r"\$\{(\w+)\}", lambda m: environment.get(m.group(1), ""), word)
                for word in shlex.split(line)]

    def _specifiers(self, line: str) -> str:
        values = {"i": self.instance, "I": self.instance, "n": self.name, "%": "%"}
        return re.sub(r"%(.)", lambda m: values.get(m.group(1), m.group()), line)

    def start(self) -> int:
        if self.running():
            return self.pid()
        settings = self.service()
        environment = self.environment(settings)
        user = (settings.get("User") or [None])[0]
        if user:
            account = pwd.getpwnam(user)
            environment.update(HOME=on_machine(account.pw_dir, self.root), USER=user,
                               LOGNAME=user)
        options = {}
        if user and os.geteuid() == 0:
            options = {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []}
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as log:
            process = subprocess.Popen(
                self.command(settings, environment), env=environment,
                cwd=(settings.get("WorkingDirectory") or ["/"])[0], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **options)
        self.pid_file.write_text(str(process.pid))
        return process.pid

    def pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def running(self) -> bool:
        pid = self.pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        return state != "Z"

    def stop(self) -> None:
        pid = self.pid()
        if pid is None:
            return
        timeout = min(float((self.service().get("TimeoutStopSec") or ["90"])[0]),
                      STOP_SECONDS_CAP)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        self.pid_file.unlink(missing_ok=True)


def read_environment_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines as systemd's ``EnvironmentFile=`` reads them (comments skipped, one
    level of quotes removed)."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")) or "=" not in line:
            continue
        key, value = line.split("=", 1)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def main(argv: list[str]) -> int:
    root = Path(os.environ[ROOT_ENV])
    verb, *rest = argv
    names = [name for name in rest if not name.startswith("-")]
    if verb == "daemon-reload":
        return 0
    if verb in ("enable", "start") and (verb == "start" or "--now" in rest):
        for name in names:
            Unit(root, name).start()
        return 0
    if verb == "enable":
        return 0
    if verb == "stop":
        for name in names:
            Unit(root, name).stop()
        return 0
    if verb == "restart":
        for name in names:
            Unit(root, name).stop()
            Unit(root, name).start()
        return 0
    print(f"systemctl (test): {verb} is not understood", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
