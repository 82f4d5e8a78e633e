"""Partition definitions, one home for all of them."""

from __future__ import annotations

from dagster import DailyPartitionsDefinition, DynamicPartitionsDefinition

from mostovik_pipelines.settings import setting

cbr_daily_partition = DailyPartitionsDefinition(
    start_date=setting("MOSTOVIK_CBR_START_DATE", "2020-01-01"),
    timezone="Europe/Moscow",
    # The CBR publishes tomorrow's rates in the afternoon, so the newest partition is tomorrow's.
    # A daily partition exists once its day is over: +1 adds today, +2 tomorrow.
    end_offset=2,
)

erp_work_orders_daily_partition = DailyPartitionsDefinition(
    start_date=setting("MOSTOVIK_ERP_START_DATE", "2026-01-01"),
    timezone=setting("MOSTOVIK_ERP_TIMEZONE", "Europe/Moscow"),
    end_offset=1,  # today's window, still filling, is synced too
)
"""Daily windows of the work orders' ``updated_at``."""

material_deliveries_file_versions = DynamicPartitionsDefinition(
    name="material_deliveries_file_versions")
"""One partition per delivery report file version, ``<name>@<hash>``, added by the sensor."""

cbr_metal_prices_daily_partition = DailyPartitionsDefinition(
    start_date=setting("MOSTOVIK_CBR_METAL_PRICES_START_DATE", "2026-01-01"),
    timezone="Europe/Moscow",
    end_offset=1,  # today's partition too
)
"""Days of cbr_metal_prices, Moscow time."""
