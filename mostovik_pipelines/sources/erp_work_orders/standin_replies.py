"""How the ERP stand-in answers: JSON in UTF-8 with Russian text unescaped, as the ERP sends it,
and what it refuses as ``{"error", "message"}`` with the status the real API gives."""

from __future__ import annotations

import json
from typing import Any

from mostovik_pipelines.standin.endpoint import EndpointError
from mostovik_pipelines.standin.reply import Reply


class ErpError(EndpointError):
    """A request or control the ERP refuses: answered with ``status`` and a JSON error."""

    def __init__(self, status: int, error: str, message: str) -> None:
        super().__init__(status, message)
        self.error = error

    def reply(self) -> Reply:
        headers = {"WWW-Authenticate": 'Bearer realm="erp"'} if self.status == 401 else {}
        return json_reply(self.status, {"error": self.error, "message": self.message}, headers)


def json_reply(status: int, payload: Any, headers: dict[str, str] | None = None) -> Reply:
    """JSON in UTF-8, Russian text unescaped, as the ERP sends it."""
    return json_text_reply(status, json_text(payload), headers)


def json_text_reply(status: int, text: str, headers: dict[str, str] | None = None) -> Reply:
    return Reply(status, text.encode(), "application/json; charset=utf-8", headers or {})


def json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
