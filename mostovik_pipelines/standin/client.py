"""Drives a running stand-in from tests, benchmarks and the chaos suite: queues faults, reads the
request log, and calls each endpoint's controls (:mod:`.server` lists them), over HTTP, so the
stand-in may run in another process."""

from __future__ import annotations

import base64
import os
import weakref
from datetime import date, datetime
from typing import Any

import httpx


class StandinClient:
    """Drives a running stand-in's controls (from tests, or across processes)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._pool: httpx.Client | None = None
        self._pool_pid = 0

    @property
    def _http(self) -> httpx.Client:
        """One keep-alive pool per process: a bare ``httpx.get`` builds a TLS context per call
        (~70 ms on a busy CI machine, several times per test), and a pool inherited through a
        fork must not be shared with the parent. Closed when the client is collected."""
        if self._pool is None or self._pool_pid != os.getpid():
            self._pool, self._pool_pid = httpx.Client(base_url=self.base_url), os.getpid()
            weakref.finalize(self, self._pool.close)
        return self._pool

    def fault(self, kind: str, *, route: str = "cbr", times: int = 1, **options: Any) -> None:
        self._post("/_control/faults", {"kind": kind, "route": route, "times": times, **options})

    def serve_bytes(self, content: bytes, *, route: str = "cbr", times: int = 1,
                    **options: Any) -> None:
        """Answer the next requests with exactly ``content`` (a ``raw`` fault)."""
        self.fault("raw", route=route, times=times,
                   content_b64=base64.b64encode(content).decode("ascii"), **options)

    def clear_faults(self) -> None:
        self._http.delete("/_control/faults").raise_for_status()

    def hanging(self, route: str | None = None) -> list[dict[str, Any]]:
        """The requests hanging now (route, query, since)."""
        hanging = self._http.get("/_control/hanging").json()
        return [r for r in hanging if route is None or r["route"] == route]

    def release_hangs(self) -> int:
        """Let every request hanging now answer at once; how many there were."""
        return self._post("/_control/faults/release", {})["released"]

    def requests(self, route: str | None = None) -> list[dict[str, Any]]:
        served = self._http.get("/_control/requests").json()
        return [r for r in served if route is None or r["route"] == route]

    def forget_requests(self) -> None:
        self._http.delete("/_control/requests").raise_for_status()

    def reset(self, route: str) -> None:
        """Forget what tests changed in one endpoint."""
        self._http.delete(f"/_control/{route}").raise_for_status()

    def control(self, route: str, name: str, payload: dict[str, Any]) -> Any:
        """``POST /_control/<route>/<name>``: an endpoint's own control."""
        return self._post(f"/_control/{route}/{name}", payload)

    def change_cbr_rates(self, day: str, set_values: dict[str, str] | None = None,
                         remove: list[str] | None = None) -> None:
        self._post("/_control/cbr/changes",
                   {"date": day, "set": set_values or {}, "remove": remove or []})

    def reset_cbr_rates(self) -> None:
        self._http.delete("/_control/cbr/changes").raise_for_status()

    def publish_cbr_until(self, day: str | None) -> None:
        self._post("/_control/cbr/published_until", {"date": day})

    def reset_erp(self, seed: int | None = None) -> None:
        """Back to the seeded work orders (``seed``, default the fixed one), no changes, no
        volumes, and the bearer token and page-token TTL the server started with."""
        self._post("/_control/erp/reset", {} if seed is None else {"seed": seed})

    def set_erp_volume(self, day: str | date, records: int) -> None:
        """Give the Moscow ``day`` that many seeded work orders (up to 999,999)."""
        self._post("/_control/erp/volume", {"day": str(day), "records": records})

    def change_erp_work_orders(self, changes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Apply changes (``{"op": "update" | "delete" | "restore", "id", "updated_at",
        "version"?, fields?}``), all or none; returns each change's resulting item."""
        return self._post("/_control/erp/changes", {"changes": changes})["changed"]

    def update_erp_work_order(self, work_order_id: str, updated_at: str | datetime,
                              **fields: Any) -> dict[str, Any]:
        """A new version at ``updated_at`` (later than the current one) with ``fields`` changed
        (status, amount, title, object_code, planned_start, planned_finish; version to force
        one); an old record updated today is a late update."""
        return self._change("update", work_order_id, updated_at, fields)

    def delete_erp_work_order(self, work_order_id: str, updated_at: str | datetime,
                              version: int | None = None) -> dict[str, Any]:
        """Tombstone the record at ``updated_at``; it keeps its other fields."""
        forced = {} if version is None else {"version": version}
        return self._change("delete", work_order_id, updated_at, forced)

    def restore_erp_work_order(self, work_order_id: str, updated_at: str | datetime,
                               **fields: Any) -> dict[str, Any]:
        """Bring a tombstoned record back with a newer version, optionally changing fields."""
        return self._change("restore", work_order_id, updated_at, fields)

    def erp_window_state(self, updated_from: str | datetime,
                         updated_to: str | datetime) -> list[dict[str, Any]]:
        """The oracle: every work order whose latest ``updated_at`` is in
        ``[updated_from, updated_to)``, in (updated_at, id) order, as a perfect sync holds it."""
        response = self._http.get("/_control/erp/work-orders", timeout=120,
                                  params={"updated_from": _iso(updated_from),
                                          "updated_to": _iso(updated_to)})
        response.raise_for_status()
        return response.json()["items"]

    def set_erp_token(self, token: str | None) -> None:
        """Require ``Authorization: Bearer <token>`` on the work-orders API (None: open)."""
        self._post("/_control/erp/auth", {"token": token})

    def set_erp_page_token_ttl(self, seconds: float) -> None:
        """How long a page token lives, counted from its issue (applies to issued ones too)."""
        self._post("/_control/erp/page_tokens", {"ttl_seconds": seconds})

    def expire_erp_page_tokens(self) -> None:
        """Every page token issued so far answers 410."""
        self._post("/_control/erp/page_tokens/expire", {})

    def _change(self, op: str, work_order_id: str, updated_at: str | datetime,
                fields: dict[str, Any]) -> dict[str, Any]:
        change = {"op": op, "id": work_order_id, "updated_at": _iso(updated_at), **fields}
        return self.change_erp_work_orders([change])[0]

    def _post(self, path: str, payload: dict[str, Any]) -> Any:
        response = self._http.post(path, json=payload)
        response.raise_for_status()
        return response.json()


def _iso(moment: str | datetime) -> str:
    return moment if isinstance(moment, str) else moment.isoformat()
