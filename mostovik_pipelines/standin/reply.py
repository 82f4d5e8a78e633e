"""What a stand-in route answers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Reply:
    status: int
    body: bytes
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)
