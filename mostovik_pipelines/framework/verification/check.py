"""The asset check a verification records per partition, ``matches_source``: declared on every
source's asset (:mod:`..assets.factory`), planned by every load and evaluated by the source's
verification job (:mod:`.schedule`)."""

import warnings

from dagster import AssetCheckKey, AssetCheckSpec, AssetKey, PreviewWarning

from mostovik_pipelines.framework.spec import SourceSpec

MATCHES_SOURCE = "matches_source"


def verification_check_spec(spec: SourceSpec) -> AssetCheckSpec:
    """The check the verification records per partition (declared on the source's asset)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreviewWarning)
        return AssetCheckSpec(
            MATCHES_SOURCE, asset=spec.name, partitions_def=spec.partitions_def,
            blocking=False,
            description="The table holds exactly what the source says for the partition, as "
                        "the scheduled verification found it (a load plans it, the "
                        f"verification job {spec.name}_verification_job evaluates it).")


def verification_check_key(spec: SourceSpec) -> AssetCheckKey:
    return AssetCheckKey(AssetKey(spec.name), MATCHES_SOURCE)
