"""The local stand-in for external sources, used by ``make demo``, ``make dev`` and the tests:
the generic server, its client and what an endpoint is. Each source's own endpoint lives in its
folder, ``mostovik_pipelines/sources/<name>/standin.py``, found by :mod:`.endpoint`."""

from mostovik_pipelines.standin.client import StandinClient
from mostovik_pipelines.standin.server import StandinServer

__all__ = ["StandinClient", "StandinServer"]
