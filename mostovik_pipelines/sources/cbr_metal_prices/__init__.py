"""Central Bank of Russia prices of precious metals: the declaration (:mod:`.source`), the
format (:mod:`.parse`) and the stand-in endpoint (:mod:`.standin`)."""

from mostovik_pipelines.sources.cbr_metal_prices.parse import fetch_metal_prices, parse_metal_prices
from mostovik_pipelines.sources.cbr_metal_prices.source import (
    SOURCE,
    cbr_metal_prices_daily_partition,
    cbr_metal_prices_table,
)

__all__ = ["SOURCE", "cbr_metal_prices_daily_partition", "cbr_metal_prices_table",
           "fetch_metal_prices", "parse_metal_prices"]
