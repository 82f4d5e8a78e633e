"""The local stand-in for external sources, used by ``make demo``, ``make dev`` and the tests."""

from mostovik_pipelines.standin.client import StandinClient
from mostovik_pipelines.standin.erp import ErpStandin
from mostovik_pipelines.standin.server import StandinServer

__all__ = ["ErpStandin", "StandinClient", "StandinServer"]
