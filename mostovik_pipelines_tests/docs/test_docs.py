"""The documents' examples, tried as a new user would: every run config they show is accepted by
its job (the landed-payload re-run is run for real), and every `mostovik` command line they show
is one the command parses, options, choices and values included.

A run config is shown as a fenced ``yaml`` block whose first line is ``# run config of <job>``;
a command line is a line of a fenced ``sh`` block starting with ``mostovik`` (or
``.venv/bin/mostovik``), or of a ``console`` block after its ``$`` prompt. ``RUN_ID`` stands for a
run id."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
import yaml
from dagster import DagsterInvalidConfigError, validate_run_config

from mostovik_pipelines.cli import main
from mostovik_pipelines.definitions import defs
from mostovik_pipelines.sources import cbr_daily_rates
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.runs import load_metadata, run_partition
from mostovik_pipelines_tests.support.warehouse import physical_snapshot

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "deploy" / "README.md",
                    *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^ *```(\w*)\n(.*?)^ *```", re.MULTILINE | re.DOTALL)
RUN_CONFIG_OF = re.compile(r"#\s*run config of (\w+)")
A_RUN_ID = "6f1c2a90-0b9e-4d12-8a51-aa04c3e7d5b1"
"""What ``RUN_ID`` stands for: a fixed id, so that every test worker collects the same tests."""


def _blocks(language: str):
    for document in DOCUMENTS:
        for match in FENCE.finditer(document.read_text(encoding="utf-8")):
            if match.group(1) == language:
                yield document.relative_to(ROOT), match.group(2)


def shown_run_configs() -> list[tuple[str, str, dict]]:
    """(document, job, run config) of every run config the documents show."""
    found = []
    for document, block in _blocks("yaml"):
        first_line = block.lstrip().splitlines()[0]
        if job := RUN_CONFIG_OF.match(first_line):
            found.append((str(document), job.group(1), yaml.safe_load(block)))
    return found


def shown_commands() -> list[tuple[str, list[str]]]:
    """(document, arguments) of every `mostovik` command line the documents show."""
    found = []
    shown = [*_blocks("sh"), *((document, "\n".join(
        line.removeprefix("$ ") for line in block.replace("\\\n", " ").splitlines()
        if line.startswith("$ ")))
        for document, block in _blocks("console"))]
    for document, block in shown:
        for line in block.replace("\\\n", " ").splitlines():
            if not line.lstrip().startswith(("mostovik ", ".venv/bin/mostovik ")):
                continue
            words = shlex.split(line, comments=True)
            if words:
                found.append((str(document),
                              [A_RUN_ID if w == "RUN_ID" else w for w in words[1:]]))
    return found


def parse_command(arguments: list[str]) -> click.Context:
    """Parses a command line as `mostovik` would, down to its subcommand, running nothing."""
    command: click.Command = main
    context = click.Context(main, info_name="mostovik")
    words = list(arguments)
    while isinstance(command, click.Group):
        name, *words = words
        subcommand = command.get_command(context, name)
        if subcommand is None:
            raise click.UsageError(f"no such command: {name}")
        context, command = click.Context(subcommand, info_name=name, parent=context), subcommand
    return command.make_context(context.info_name, words, parent=context.parent)


def test_the_documents_show_run_configs_and_commands():
    assert shown_run_configs(), "no run config found in the documents"
    assert len(shown_commands()) >= 10, "the documents' command blocks were not found"


@pytest.mark.parametrize(("document", "job", "run_config"), shown_run_configs(),
                         ids=lambda value: value if isinstance(value, str) else "")
def test_every_run_config_the_documents_show_is_accepted_by_its_job(document, job, run_config):
    validate_run_config(defs.resolve_job_def(job), run_config)


def test_the_form_the_documents_used_to_show_is_refused_so_the_check_can_fail():
    with pytest.raises(DagsterInvalidConfigError):
        validate_run_config(defs.resolve_job_def("cbr_daily_rates_job"), {"ops": {
            "extract_cbr_daily_rates": {"config": {"reuse_landed": True}}}})


@pytest.mark.parametrize(("document", "arguments"), shown_commands(),
                         ids=lambda value: value if isinstance(value, str) else " ".join(value))
def test_every_command_the_documents_show_parses(document, arguments):
    parse_command(arguments)


def test_a_command_the_cli_does_not_know_fails_to_parse():
    with pytest.raises(click.UsageError):
        parse_command(["jobs", "list", "--status", "exploded"])


def test_the_shown_landed_payload_re_run_loads_without_calling_the_source(
    sqlite_warehouse_url, standin_server, standin, instance, tmp_path
):
    (document, job_name, run_config), = [shown for shown in shown_run_configs()
                                         if shown[1] == "cbr_daily_rates_job"]
    location = code_location_for(sqlite_warehouse_url, standin_server, tmp_path,
                                 [cbr_daily_rates.SOURCE])
    job = location.resolve_job_def(job_name)
    assert run_partition(job, "2026-11-02", instance).success
    before = physical_snapshot(sqlite_warehouse_url, "cbr_daily_rates")
    standin.forget_requests()

    reused = job.execute_in_process(partition_key="2026-11-02", instance=instance,
                                    run_config=run_config, raise_on_error=False)

    assert reused.success, document
    assert standin.requests("cbr") == []
    assert load_metadata(instance, reused.run_id)["unchanged"] == 12
    assert physical_snapshot(sqlite_warehouse_url, "cbr_daily_rates") == before
