"""The commands the README and docs/*.md show, as an operator types them, and a runner that
types them: the documents' examples run by the tests as written.

A command is a line of a fenced ``sh`` block (a ``\\`` at a line's end continues it), a
``$``-prompted line of a ``console`` block, whose following lines are the output the document
shows, or a line of an indented block whose first line starts as a command does
(:data:`COMMAND_STARTS`). ``text`` blocks are synopses (``S``, ``A``, ``WHY`` stand for values),
not commands; a command named in prose is a reference to one of these, not one to type.
A test picks a command by its document and how it starts (:func:`shown_command`) and runs the
whole line the document shows through ``bash`` (:func:`run_shown`), placeholders such as
``RUN_ID`` replaced by real values; :func:`not_run` names every shown command no test picks.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", *sorted(str(path.relative_to(REPO))
                                  for path in (REPO / "docs").glob("*.md")),
             "deploy/README.md", "benchmarks/README.md")
FENCE = re.compile(r"^ *```(\w*)\n(.*?)^ *```", re.MULTILINE | re.DOTALL)
INDENTED = re.compile(r"(?:^|\n\n)((?:    \S.*(?:\n|$))+)")
"""A block indented four spaces after a blank line (Markdown's indented code block)."""
COMMAND_STARTS = ("python ", "make ", "mostovik ", "dagster ", "dg ", ".venv/")
"""How the first line of an indented block that is a command starts (other indented blocks are
shown output or text)."""
STANDS_FOR_ANY = {
    r"\b[0-9a-f]{8}\b": "[0-9a-f]{8}",  # a run id as shown in output: its first 8 hex digits
    r"(?<=backfill )[a-z]{8}\b": "[a-z]{8}",  # a backfill id (Dagster's: 8 lowercase letters)
    r"(?<!\d)\.\.\.(?!\d)": ".*",  # left out (between dates it is a range: literal)
}
"""What a line of shown output holds that stands for any value, and the pattern it becomes."""
SHOWN_VARIABLE = re.compile("|".join(f"({shown})" for shown in STANDS_FOR_ANY))


@dataclass(frozen=True)
class ShownCommand:
    """One command line of a document, and the output the document shows after it."""

    document: str
    line: str
    output: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        return f"{self.document}: {self.line}"


def _joined(lines: Iterable[str]) -> list[str]:
    """The lines with every ``\\``-continued line joined to the next."""
    joined, pending = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].rstrip() + " "
            continue
        joined.append((pending + line.strip()) if pending else line)
        pending = ""
    return joined


def shown_commands(documents: Iterable[str] = DOCUMENTS) -> list[ShownCommand]:
    """Every command line the documents show, in the documents' order."""
    found = []
    for document in documents:
        for match in FENCE.finditer((REPO / document).read_text(encoding="utf-8")):
            language, block = match.group(1), match.group(2)
            if language == "sh":
                found.extend(ShownCommand(document, line.strip())
                             for line in _joined(block.splitlines()) if line.strip())
            elif language == "console":
                lines = _joined(block.splitlines())
                prompts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
                for i, start in enumerate(prompts):
                    end = prompts[i + 1] if i + 1 < len(prompts) else len(lines)
                    found.append(ShownCommand(document, lines[start][2:].strip(),
                                              tuple(lines[start + 1:end])))
        found.extend(_indented_commands(document))
    return found


def _indented_commands(document: str) -> list[ShownCommand]:
    """The command lines of ``document``'s indented blocks (its fenced blocks left out)."""
    text = FENCE.sub("", (REPO / document).read_text(encoding="utf-8"))
    found = []
    for match in INDENTED.finditer(text):
        lines = _joined(match.group(1).splitlines())
        if lines and lines[0].strip().startswith(COMMAND_STARTS):
            found.extend(ShownCommand(document, line.strip()) for line in lines if line.strip())
    return found


def shown_command(document: str, starts_with: str) -> ShownCommand:
    """The one command of ``document`` that starts with ``starts_with``; fails (so the test does)
    when the document no longer shows it, or shows several."""
    matching = [command for command in shown_commands([document])
                if command.line.startswith(starts_with)]
    assert len(matching) == 1, (
        f"{document} shows {len(matching)} command(s) starting with {starts_with!r}: {matching}")
    return matching[0]


def not_run(picked: Iterable[tuple[str, str]]) -> list[str]:
    """The shown commands that none of ``picked`` (document, start) selects."""
    picked = list(picked)
    return [str(command) for command in shown_commands()
            if not any(command.document == document and command.line.startswith(start)
                       for document, start in picked)]


def run_shown(command: ShownCommand, *, cwd: Path, environment: Mapping[str, str],
              exit_code: int = 0, timeout: float = 600,
              placeholders: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """Type ``command`` into ``bash`` in ``cwd`` (its placeholders replaced) and check it exits
    with ``exit_code``; the finished process, its output combined in ``stdout``."""
    line = command.line
    for placeholder, value in (placeholders or {}).items():
        line = re.sub(rf"\b{placeholder}\b", value, line)
    typed = subprocess.run(["bash", "-c", line], cwd=cwd, env=dict(environment), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    assert typed.returncode == exit_code, (
        f"{command.document}: `{line}` exited {typed.returncode}, the document implies "
        f"{exit_code}:\n{typed.stdout[-4000:]}")
    return typed


def shown_output_pattern(shown_line: str) -> re.Pattern:
    """A line of shown output as a pattern: its run and backfill ids stand for any, a ``...``
    for anything."""
    patterns = list(STANDS_FOR_ANY.values())
    parts, literal_from = [], 0
    for match in SHOWN_VARIABLE.finditer(shown_line.strip()):
        parts += [re.escape(shown_line.strip()[literal_from:match.start()]),
                  patterns[match.lastindex - 1]]
        literal_from = match.end()
    parts.append(re.escape(shown_line.strip()[literal_from:]))
    return re.compile("".join(parts))


def assert_shows(output: str, shown_lines: Iterable[str]) -> None:
    """Every line the document shows (``...`` alone: lines left out) is a line of ``output``,
    in the same order."""
    lines = [line.strip() for line in output.splitlines()]
    position = 0
    for shown_line in shown_lines:
        if shown_line.strip() in ("", "..."):
            continue
        pattern = shown_output_pattern(shown_line)
        found = next((i for i in range(position, len(lines)) if pattern.fullmatch(lines[i])),
                     None)
        assert found is not None, f"the output has no line {shown_line.strip()!r} (in order):\n" \
                                  f"{output[-4000:]}"
        position = found + 1
