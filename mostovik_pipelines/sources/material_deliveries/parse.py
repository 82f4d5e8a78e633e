"""A delivery report file version as received: its bytes from the inbox (or the archive), and
the report read by :mod:`.report` (its format, and what is refused unread), imported by the
transform step only: it needs pandas and Arrow.
"""

from __future__ import annotations

from mostovik_pipelines.core.settings import setting
from mostovik_pipelines.framework.spec import (
    ExtractRequest,
    ParsedRows,
    RawPayload,
    TransformRequest,
)
from mostovik_pipelines.resources.inbox import file_name_of

MAX_FILE_BYTES = int(setting("MOSTOVIK_INBOX_MAX_FILE_BYTES", str(50 * 1024 * 1024)))


def extract(request: ExtractRequest) -> RawPayload:
    """The file version's bytes, from the inbox or (re-processing) the archive."""
    content, modified_at = request.resource.read_version(request.partition_key)
    name = file_name_of(request.partition_key)
    return RawPayload(content=content, content_type=_content_type(content), origin=name,
                      published_at=modified_at)


def transform(request: TransformRequest) -> ParsedRows:
    from mostovik_pipelines.sources.material_deliveries.report import parse_delivery_report

    return parse_delivery_report(request.content, file_name_of(request.partition_key),
                                 request.partition_key, MAX_FILE_BYTES, request.report_shape)


def _content_type(content: bytes) -> str:
    if content.startswith(b"PK\x03\x04"):
        return "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"
    return "text/csv"
