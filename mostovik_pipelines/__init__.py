"""Mostovik back-office pipelines: a Dagster code location.

``dagster job execute -m mostovik_pipelines`` finds the code location's ``defs`` here. It is
loaded on first use, so that importing a piece of the package (the loader in a benchmark, the
warehouse migrations) does not load Dagster and every source with it.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "defs":
        from mostovik_pipelines.definitions import defs

        return defs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "defs"])
