"""The freshness alerts: the sensor reads the freshness states the daemon records, through
Dagster APIs that are private in 1.13 (``FreshnessStateChange``, ``FreshnessState``,
``get_freshness_state_records``): this pins what it relies on without starting a daemon (the
webserver test proves the whole path with one)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from dagster import AssetKey, DagsterInstance, build_sensor_context
from dagster._core.definitions.freshness import FreshnessState, FreshnessStateChange

from mostovik_pipelines.framework.runs.alerts import alert_sensors
from mostovik_pipelines.resources.notifier import AlertNotifierResource
from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines_tests.support.webhook import WebhookReceiver

STALE = "erp_work_orders"


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as running:
        yield running


def _turn(instance: DagsterInstance, state: FreshnessState, previous: FreshnessState) -> None:
    """What the daemon's freshness evaluation records when a source's state changes."""
    instance._report_runless_asset_event(FreshnessStateChange(
        key=AssetKey(STALE), new_state=state, previous_state=previous,
        state_change_timestamp=time.time()))


def test_a_source_turning_stale_alerts_once_and_again_only_after_being_fresh(receiver):
    [sensor] = [s for s in alert_sensors(ALL_SOURCES) if s.name == "freshness_alerts"]
    notifier = AlertNotifierResource(webhook_url=receiver.url)
    cursor = None

    def tick(instance: DagsterInstance) -> None:
        nonlocal cursor
        context = build_sensor_context(instance=instance, cursor=cursor,
                                       resources={"alert_notifier": notifier})
        sensor(context)
        cursor = context.cursor

    with DagsterInstance.ephemeral() as instance:
        tick(instance)
        assert receiver.alerts == []
        _turn(instance, FreshnessState.FAIL, FreshnessState.PASS)
        tick(instance)
        tick(instance)
        assert [(a["kind"], a["source"], a["job_status"]) for a in receiver.alerts] == [
            ("freshness", STALE, "stale")]
        assert "due within 2:00:00 of its last load" in receiver.alerts[0]["message"]
        _turn(instance, FreshnessState.PASS, FreshnessState.FAIL)
        tick(instance)
        time.sleep(0.01)
        _turn(instance, FreshnessState.FAIL, FreshnessState.PASS)
        tick(instance)
        assert len(receiver.alerts) == 2
