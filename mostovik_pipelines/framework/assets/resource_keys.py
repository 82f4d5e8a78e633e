"""The resource keys every source's steps run with; the code location binds them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mostovik_pipelines.framework.spec import SourceSpec

WAREHOUSE_KEY = "warehouse"
LANDING_KEY = "landing"


def source_resource_key(spec: SourceSpec) -> str:
    """The key of the source's own resource (its HTTP client, its inbox)."""
    return f"{spec.name}_source"
