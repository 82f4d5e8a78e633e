"""XML answers of a source, parsed safely: a document that declares a DTD or entities is
refused before anything is expanded (entity bombs, external entities), whatever its encoding or
where the declaration stands; a malformed or unreadable one is the source's contract broken."""

from __future__ import annotations

import contextlib
import xml.etree.ElementTree as ET
from xml.parsers import expat

from mostovik_pipelines.core.errors import SourceContractError


def parse_xml(content: bytes, document: str) -> ET.Element:
    """The root element of ``content``; ``document`` names what the source sends (in the
    error, e.g. ``XML_daily``), which never declares a DTD."""
    _refuse_dtd(content, document)
    try:
        return ET.fromstring(content)
    except ET.ParseError as exc:
        raise SourceContractError(f"response is not well-formed XML ({exc})") from exc
    except (LookupError, UnicodeError) as exc:
        raise SourceContractError(f"response has an unreadable encoding ({exc})") from exc


def _refuse_dtd(content: bytes, document: str) -> None:
    def refuse(*_args: object) -> None:
        raise SourceContractError(
            f"response declares a DTD or entities, which {document} never does")

    scanner = expat.ParserCreate()
    scanner.StartDoctypeDeclHandler = refuse
    scanner.EntityDeclHandler = refuse
    # A document that is not well-formed is left to the parse, which says where and why.
    with contextlib.suppress(expat.ExpatError, LookupError, UnicodeError, ValueError):
        scanner.Parse(content, True)
