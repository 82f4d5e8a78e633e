"""The ERP sync's calendar, run by the real ``dagster-daemon`` on a fake clock (libfaketime,
support/fake_clock.py) started just before the ticks each test names, against the stand-in ERP and
a real warehouse; read as an operator would, from run storage and the table:

* the first tick after midnight syncs the closed window: an order changed at 23:30 is in;
* the daemon down across midnight (22:06 to 05:30): the tick it catches up syncs the window;
* no window has two runs at once, and the runs launched are counted.
"""

from __future__ import annotations

import pytest

from mostovik_pipelines.framework.automation.partition_states import partition_states
from mostovik_pipelines.sources import erp_work_orders
from mostovik_pipelines.standin import StandinClient
from mostovik_pipelines_tests.support.schedule_calendar import (
    day_after,
    moscow,
    requested_because,
    runs_at_once,
)
from mostovik_pipelines_tests.support.warehouse import table_rows

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

ERP = erp_work_orders.SOURCE


def _window(standin: StandinClient, day: str) -> set[tuple[str, int]]:
    """The oracle: (id, version) of every work order whose latest change is in the window."""
    return {(item["id"], item["version"]) for item in standin.erp_window_state(
        moscow(day, 0), moscow(day_after(day), 0))}


def _synced(url: str, day: str) -> set[tuple[str, int]]:
    return {(row["id"], row["version"]) for row in table_rows(url, "erp_work_orders")
            if row["window_date"].isoformat() == day}


def _change_late_in_the_day(standin: StandinClient, day: str) -> dict:
    """A work order of ``day`` changed at 23:30 of it: after the day's last hourly sync."""
    earlier = next(item for item in standin.erp_window_state(moscow(day, 0), moscow(day, 23))
                   if not item["deleted"])
    return standin.update_erp_work_order(earlier["id"], moscow(day, 23, 30).isoformat(),
                                         amount="777.77")


def test_the_first_erp_tick_after_midnight_syncs_the_window_an_order_changed_in_at_23_30(
        calendar):
    cal = calendar("erp_work_orders_schedule", lookback={"erp_work_orders": 1})
    day = "2026-11-10"
    first = cal.tick("erp_work_orders_schedule", moscow(day, 23, 5))
    assert requested_because(first) == [f"missing {day_after(day, -1)}; newest {day}"]

    changed = _change_late_in_the_day(cal.standin, day)
    after_midnight = cal.tick("erp_work_orders_schedule", moscow(day_after(day), 0, 5))
    assert requested_because(after_midnight) == [f"window_closed {day}; newest {day_after(day)}"]
    assert (changed["id"], changed["version"]) in _synced(cal.warehouse_url, day)
    assert _synced(cal.warehouse_url, day) == _window(cal.standin, day)
    state = partition_states(cal.daemon.instance, ERP, [day], moscow(day, 0))[day]
    assert state.final

    assert runs_at_once(cal, ERP) == []
    assert len(cal.launched) == 2


def test_the_daemon_down_across_midnight_catches_the_closed_window_up_when_it_is_back(calendar):
    cal = calendar("erp_work_orders_schedule", lookback={"erp_work_orders": 1})
    day = "2026-11-12"
    cal.tick("erp_work_orders_schedule", moscow(day, 22, 5))
    cal.daemon.stop()  # down from about 22:06 to 05:30
    changed = _change_late_in_the_day(cal.standin, day)

    caught_up = cal.tick("erp_work_orders_schedule", moscow(day_after(day), 5, 5),
                         started_at=moscow(day_after(day), 5, 30),
                         catch_up_since=moscow(day, 22, 6))
    # Back at 05:30, Dagster evaluates the newest tick it missed (05:05), none at midnight: it
    # asks for the closed window with today's.
    assert requested_because(caught_up) == [f"window_closed {day}; newest {day_after(day)}"]
    assert (changed["id"], changed["version"]) in _synced(cal.warehouse_url, day)
    assert _synced(cal.warehouse_url, day) == _window(cal.standin, day)
    assert partition_states(cal.daemon.instance, ERP, [day], moscow(day, 0))[day].final
    assert runs_at_once(cal, ERP) == []
    assert len(cal.launched) == 2


