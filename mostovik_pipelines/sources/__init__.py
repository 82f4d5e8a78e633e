"""One module per source. Each exposes ``SOURCE``, its declaration; modules are discovered here,
so adding a source means adding a module (and its table's migration), nothing else."""

from __future__ import annotations

import importlib
import pkgutil

from mostovik_pipelines.etl.spec import SourceSpec


def discover_sources() -> tuple[SourceSpec, ...]:
    """Every ``SOURCE`` declared by a module of this package, in name order."""
    specs = []
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        spec = getattr(module, "SOURCE", None)
        if isinstance(spec, SourceSpec):
            specs.append(spec)
    names = [spec.name for spec in specs]
    if len(names) != len(set(names)):
        raise ValueError(f"two sources share a name: {names}")
    return tuple(specs)


ALL_SOURCES: tuple[SourceSpec, ...] = discover_sources()
