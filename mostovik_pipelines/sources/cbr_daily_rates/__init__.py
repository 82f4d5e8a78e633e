"""Central Bank of Russia daily exchange rates: the declaration (:mod:`.source`), the format
(:mod:`.parse`) and the stand-in endpoint (:mod:`.standin`)."""

from mostovik_pipelines.sources.cbr_daily_rates.parse import fetch_daily_rates, parse_daily_rates
from mostovik_pipelines.sources.cbr_daily_rates.source import (
    SOURCE,
    cbr_daily_partition,
    cbr_daily_rates_table,
)

__all__ = ["SOURCE", "cbr_daily_partition", "cbr_daily_rates_table", "fetch_daily_rates",
           "parse_daily_rates"]
