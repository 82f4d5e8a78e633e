"""Mostovik back-office pipelines: a Dagster code location.

``dagster job execute -m mostovik_pipelines`` finds the code location's ``defs`` here.
"""

from mostovik_pipelines.definitions import defs

__all__ = ["defs"]
