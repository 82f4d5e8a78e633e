"""Who asked for an operator's run and why: the tags every such run carries."""

from __future__ import annotations

import getpass

from mostovik_pipelines.core.tags import LAUNCHED_BY_TAG, REASON_TAG, REQUESTED_BY_TAG

LAUNCHED_BY_RERUN = "mostovik jobs rerun"


def operator_name(given: str | None) -> str:
    """The name given with ``--as``, else the OS user running the command."""
    return given.strip() if given and given.strip() else getpass.getuser()


def signed_tags(requested_by: str, reason: str | None) -> dict[str, str]:
    """The tags of a run asked for by ``requested_by`` (``reason`` may be absent for one
    period)."""
    tags = {LAUNCHED_BY_TAG: LAUNCHED_BY_RERUN, REQUESTED_BY_TAG: requested_by}
    if reason and reason.strip():
        tags[REASON_TAG] = reason.strip()
    return tags
