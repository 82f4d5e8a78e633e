"""The instance's run storage refusing us (a wrong password, no such database) is a setting to
fix, not the database away: opening the instance fails within dagster-postgres' own few
retries, naming the environment variables dagster.yaml reads and never their values."""

from __future__ import annotations

import time

import pytest
from dagster import DagsterInstance

from mostovik_pipelines.core.errors import ConfigurationError
from mostovik_pipelines.platform.instance_storage import DEFAULT_OUTAGE_SECONDS
from mostovik_pipelines_tests.support.instances import create_instance_storage

pytestmark = pytest.mark.postgres


@pytest.mark.parametrize(("setting", "value", "said"), [
    ("MOSTOVIK_DAGSTER_PG_PASSWORD", "not-the-password", "password authentication failed"),
    ("MOSTOVIK_DAGSTER_PG_DB", "no_such_database", "does not exist"),
])
def test_a_refused_instance_connection_fails_at_once_naming_the_setting(
        production_home, monkeypatch, setting, value, said):
    home, environment = production_home
    create_instance_storage(home, environment)
    password = environment["MOSTOVIK_DAGSTER_PG_PASSWORD"]
    for name, setting_value in {**environment, setting: value}.items():
        monkeypatch.setenv(name, setting_value)
    started = time.monotonic()
    with pytest.raises(ConfigurationError) as refused:
        DagsterInstance.from_config(str(home))
    assert time.monotonic() - started < DEFAULT_OUTAGE_SECONDS / 3, "waited as for an outage"
    assert said in str(refused.value) and setting in str(refused.value)
    assert password not in str(refused.value)
