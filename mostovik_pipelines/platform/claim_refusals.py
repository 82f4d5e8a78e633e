"""What a run claim's connection refused for good tells the operator (:mod:`.claims`): the
settings behind it, named by the environment variables dagster.yaml reads them from, never by
their values."""

from __future__ import annotations

from dagster import DagsterInstance

from mostovik_pipelines.core.errors import Verdict


def refusal_message(verdict: Verdict, settings: dict[str, str]) -> str:
    """What an operator must fix, naming the settings (their environment variables, never their
    values) behind the refused connection."""
    def named(*fields: str) -> str:
        names = [settings[field] for field in fields if field in settings]
        return " / ".join(names) if names else "the run storage settings in dagster.yaml"

    if verdict.reason.startswith("authentication failed"):
        fix = f"Check the user and password ({named('username', 'password', 'postgres_url')})"
    elif verdict.reason.startswith("no such database or role"):
        fix = f"Check the database and user ({named('db_name', 'username', 'postgres_url')})"
    elif verdict.reason.startswith("a bad setting"):
        fix = f"Check the connection options ({named('params', 'postgres_url')})"
    elif verdict.reason.startswith("too many connections"):
        fix = ("The database serves no more clients: raise its max_connections or run fewer "
               f"processes ({named('hostname', 'port', 'postgres_url')})")
    else:
        fix = f"Check the run storage settings ({named(*sorted(settings))})"
    return (f"the run storage database refused the connection of the run's claim: "
            f"{verdict.reason}. {fix}; waiting would not help, so the step fails now")


def connection_settings(instance: DagsterInstance) -> dict[str, str]:
    """Each run storage connection field dagster.yaml reads from the environment, and the
    variable it reads (``{"password": "MOSTOVIK_DAGSTER_PG_PASSWORD", ...}``); read from the
    instance's reference (its configuration as written, pinned by the claim's tests)."""
    ref = instance.get_ref()
    data = ref.storage_data or ref.run_storage_data
    found: dict[str, str] = {}

    def walk(node: object, field: str) -> None:
        if isinstance(node, dict):
            if set(node) == {"env"}:
                found[field] = str(node["env"])
            for key, value in node.items():
                walk(value, key if key != "env" else field)

    walk(data.config_dict if data is not None else {}, "")
    return found
