"""A queued re-run names its code location; the daemon launches it only through a location of
that name in its workspace, so the name must be the one both workspaces give."""

from __future__ import annotations

from pathlib import Path

import yaml

from mostovik_pipelines.platform.recovery import CODE_LOCATION_MODULE, CODE_LOCATION_NAME

REPO = Path(__file__).resolve().parents[2]


def _location_names(workspace: Path) -> list[str]:
    entries = yaml.safe_load(workspace.read_text(encoding="utf-8"))["load_from"]
    return [next(iter(entry.values()))["location_name"] for entry in entries]


def test_the_queued_rerun_names_the_location_both_workspaces_load():
    assert _location_names(REPO / "workspace.yaml") == [CODE_LOCATION_NAME]
    assert _location_names(REPO / "deploy" / "workspace.yaml") == [CODE_LOCATION_NAME]


def test_the_location_module_is_the_one_the_dev_workspace_loads():
    [entry] = yaml.safe_load((REPO / "workspace.yaml").read_text(encoding="utf-8"))["load_from"]
    assert entry["python_module"]["module_name"].split(".")[0] == CODE_LOCATION_MODULE
