"""Partition definitions, one home for all of them."""

from __future__ import annotations

from dagster import DailyPartitionsDefinition

from mostovik_pipelines.settings import setting

cbr_daily_partition = DailyPartitionsDefinition(
    start_date=setting("MOSTOVIK_CBR_START_DATE", "2020-01-01"),
    timezone="Europe/Moscow",
    # The CBR publishes tomorrow's rates in the afternoon, so the newest partition is tomorrow's.
    # A daily partition exists once its day is over: +1 adds today, +2 tomorrow.
    end_offset=2,
)
