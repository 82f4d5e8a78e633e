"""A small file system of its own (a tmpfs) for a store to fill: the disk-full tests and the
chaos suite's full-disk fault. Mounting needs root; :func:`why_no_small_disk` says why not."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

FILLER = "filler"


def why_no_small_disk() -> str | None:
    """None where :func:`mount_small_disk` can work here, else the reason."""
    return None if os.geteuid() == 0 else "mounting a small file system needs root"


def mount_small_disk(mount_point: Path, size: str = "256k") -> None:
    """A tmpfs of ``size`` at ``mount_point`` (created); raises naming mount's error."""
    mount_point.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(mount_point)], capture_output=True, text=True)
    if mounted.returncode != 0:
        raise OSError(f"cannot mount a tmpfs at {mount_point}: {mounted.stderr.strip()}")


def unmount_small_disk(mount_point: Path) -> None:
    subprocess.run(["umount", "-l", str(mount_point)], check=False, capture_output=True)


def fill(disk: Path) -> None:
    """Write a file until the disk has no space left."""
    with (disk / FILLER).open("wb", buffering=0) as filler, contextlib.suppress(OSError):
        while True:
            filler.write(b"\0" * 4096)


def free(disk: Path) -> None:
    """Remove what :func:`fill` wrote: the space comes back."""
    (disk / FILLER).unlink(missing_ok=True)
