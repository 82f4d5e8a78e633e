"""Material delivery reports from construction sites: the declaration (:mod:`.source`) and the
file versions read (:mod:`.parse`). Its stand-in is an inbox folder, so it has no endpoint."""

from mostovik_pipelines.sources.material_deliveries.parse import extract, transform
from mostovik_pipelines.sources.material_deliveries.source import (
    SOURCE,
    material_deliveries,
    material_deliveries_file_versions,
)

__all__ = ["SOURCE", "extract", "material_deliveries", "material_deliveries_file_versions",
           "transform"]
