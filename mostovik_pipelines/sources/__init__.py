"""One folder per source, each with the same small set of files: ``source.py`` (its table,
partitions and ``SOURCE`` declaration), ``parse.py`` (its format and quirks: the extract and
transform functions), ``standin.py`` (its stand-in endpoint, for an HTTP source) and an
``__init__.py`` re-exporting ``SOURCE``. Folders are discovered here, so adding a source means
adding a folder (and its table's migration, its test and its corpus), nothing else."""

from __future__ import annotations

import importlib
import pkgutil

from mostovik_pipelines.framework.spec import SourceSpec


def discover_sources() -> tuple[SourceSpec, ...]:
    """Every ``SOURCE`` declared by a source folder of this package, in name order."""
    specs = []
    for folder in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not folder.ispkg:
            continue
        module = importlib.import_module(f"{__name__}.{folder.name}")
        spec = getattr(module, "SOURCE", None)
        if isinstance(spec, SourceSpec):
            specs.append(spec)
    names = [spec.name for spec in specs]
    if len(names) != len(set(names)):
        raise ValueError(f"two sources share a name: {names}")
    return tuple(specs)


ALL_SOURCES: tuple[SourceSpec, ...] = discover_sources()
