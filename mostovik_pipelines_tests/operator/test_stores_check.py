"""``mostovik stores check``: every store the deployment writes, reached and written once with
the environment's settings; ``--create`` makes the missing buckets (or directories) the runbook's
install step needs, on an S3 API server (moto's) and on a disk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mostovik_pipelines_tests.support.object_store import S3ApiServer, why_no_s3_api

MOSTOVIK = str(Path(sys.executable).parent / "mostovik")


def _check(environment: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([MOSTOVIK, "stores", "check", *args], env={**os.environ, **environment},
                          capture_output=True, text=True, timeout=120)


def test_missing_buckets_fail_naming_the_setting_and_create_makes_them(tmp_path):
    if reason := why_no_s3_api():
        pytest.skip(reason)
    server = S3ApiServer().start()
    try:
        environment = {**server.environment,
                       "MOSTOVIK_DATA_DIR": str(tmp_path / "data"),
                       "MOSTOVIK_LANDING_DIR": "s3://mostovik-landing/prod",
                       "MOSTOVIK_STORAGE_DIR": "s3://mostovik-outputs/prod",
                       "MOSTOVIK_INBOX_DIR": "s3://mostovik-inbox/in",
                       "MOSTOVIK_ARCHIVE_DIR": "s3://mostovik-inbox/archive"}
        refused = _check(environment)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "FAILED (MOSTOVIK_LANDING_DIR)" in refused.stdout, refused.stdout
        assert "FAILED (MOSTOVIK_INBOX_DIR)" in refused.stdout, refused.stdout

        created = _check(environment, "--create")
        assert created.returncode == 0, created.stdout + created.stderr
        assert "created bucket mostovik-landing" in created.stdout
        assert created.stdout.count("created bucket mostovik-inbox") == 1, created.stdout
        assert server.buckets.objects("mostovik-landing") == set(), "the probe is removed"

        again = _check(environment)
        assert again.returncode == 0 and "created" not in again.stdout, again.stdout
        assert again.stdout.count(" ok") == 4, again.stdout
    finally:
        server.close()


def test_directories_are_created_and_written(tmp_path):
    environment = {"MOSTOVIK_DATA_DIR": str(tmp_path / "data")}
    assert _check(environment).returncode == 1
    created = _check(environment, "--create")
    assert created.returncode == 0, created.stdout + created.stderr
    for name in ("landing", "storage", "inbox", "archive"):
        assert (tmp_path / "data" / name).is_dir()
        assert list((tmp_path / "data" / name).iterdir()) == [], "the probe is removed"
