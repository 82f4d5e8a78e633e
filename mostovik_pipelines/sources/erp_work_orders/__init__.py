"""Work orders from the ERP API: the declaration (:mod:`.source`), the API's pages and items
(:mod:`.parse`) and the stand-in endpoint (:mod:`.standin`, with its records, history and
replies in the ``standin_*`` modules)."""

from mostovik_pipelines.sources.erp_work_orders.parse import (
    PAGE_SIZE,
    STATUSES,
    extract,
    transform,
    window_bounds,
)
from mostovik_pipelines.sources.erp_work_orders.source import (
    SOURCE,
    erp_work_orders,
    erp_work_orders_daily_partition,
)

__all__ = ["PAGE_SIZE", "SOURCE", "STATUSES", "erp_work_orders",
           "erp_work_orders_daily_partition", "extract", "transform", "window_bounds"]
