"""Configurable resources: every piece of I/O the pipelines do goes through one of these."""

from mostovik_pipelines.resources.http import HttpResponse, HttpSourceResource
from mostovik_pipelines.resources.landing import LandedPayload, LandingStoreResource
from mostovik_pipelines.resources.warehouse import WarehouseResource

__all__ = [
    "HttpResponse",
    "HttpSourceResource",
    "LandedPayload",
    "LandingStoreResource",
    "WarehouseResource",
]
