"""The ERP work-orders stand-in over real HTTP: the API contract, its changes, page tokens, faults
on a given page, authentication, and a 100,000-record window."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from mostovik_pipelines.standin import StandinClient, StandinServer

DAY_FROM, DAY_TO = "2026-11-03T00:00:00+03:00", "2026-11-04T00:00:00+03:00"
THREE_DAYS = ("2026-11-02T00:00:00+03:00", "2026-11-05T00:00:00+03:00")
STATUSES = {"planned", "in_progress", "done", "cancelled"}


@pytest.fixture
def erp(standin: StandinClient) -> Iterator[StandinClient]:
    """The stand-in with the ERP at its seeded base state (the shared server outlives tests)."""
    standin.reset_erp()
    yield standin
    standin.reset_erp()


@pytest.fixture
def api(standin_server: StandinServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{standin_server.erp_url}/api/v1", timeout=30) as client:
        yield client


def first_page(api: httpx.Client, updated_from: str, updated_to: str, page_size: int = 100,
               **kwargs: Any) -> httpx.Response:
    params = {"updated_from": updated_from, "updated_to": updated_to, "page_size": page_size}
    return api.get("/work-orders", params=params, **kwargs)


def next_page(api: httpx.Client, token: str, **kwargs: Any) -> httpx.Response:
    return api.get("/work-orders", params={"page_token": token}, **kwargs)


def read_window(api: httpx.Client, updated_from: str, updated_to: str,
                page_size: int = 100) -> list[list[dict[str, Any]]]:
    """Every page of the window, as a sync source pages through it."""
    body = first_page(api, updated_from, updated_to, page_size).raise_for_status().json()
    pages = [body["items"]]
    while body["next_page_token"] is not None:
        body = next_page(api, body["next_page_token"]).raise_for_status().json()
        pages.append(body["items"])
    return pages


def flat(pages: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [item for page in pages for item in page]


def live(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records that can be updated or deleted (about 1% of the seeded ones are tombstones)."""
    return [item for item in items if not item["deleted"]]


def key(item: dict[str, Any]) -> tuple[datetime, str]:
    return datetime.fromisoformat(item["updated_at"]), item["id"]


def status_of(error: pytest.ExceptionInfo[httpx.HTTPStatusError]) -> int:
    return error.value.response.status_code


def test_pages_cover_the_oracle_in_order_without_duplicates(erp, api, standin_server):
    truth = erp.erp_window_state(*THREE_DAYS)
    assert len(truth) > 60
    for page_size in (1, 7, 100):
        pages = read_window(api, *THREE_DAYS, page_size=page_size)
        items = flat(pages)
        assert items == truth
        assert all(len(page) == page_size for page in pages[:-1])
        assert len({item["id"] for item in items}) == len(items)
    assert [key(item) for item in truth] == sorted(key(item) for item in truth)
    window = [datetime.fromisoformat(bound) for bound in THREE_DAYS]
    assert all(window[0] <= key(item)[0] < window[1] for item in truth)
    # Nightly imports stamp records alike: the id decides, and page_size=1 cut inside such runs.
    stamps = [item["updated_at"] for item in truth]
    assert len(set(stamps)) < len(stamps)
    assert standin_server.erp_url == f"{standin_server.url}/erp"


def test_items_have_the_contract_shape(erp, api):
    response = first_page(api, DAY_FROM, DAY_TO)
    assert response.headers["content-type"] == "application/json; charset=utf-8"
    items = response.json()["items"]
    assert items[0]["title"].encode() in response.content  # Cyrillic as UTF-8, not \u escapes
    for item in items:
        assert set(item) == {"id", "object_code", "title", "status", "planned_start",
                             "planned_finish", "amount", "updated_at", "version", "deleted"}
        assert item["status"] in STATUSES and isinstance(item["deleted"], bool)
        assert item["object_code"][:2].isalpha() and item["object_code"][2] == "-"
        whole, kopecks = item["amount"].split(".")
        assert whole.isdigit() and len(kopecks) == 2
        assert item["updated_at"].endswith("+03:00") and len(item["updated_at"]) == 32
        assert isinstance(item["version"], int)
        for name in ("planned_start", "planned_finish"):
            assert item[name] is None or datetime.strptime(item[name], "%Y-%m-%d")


def test_a_day_has_exactly_its_volume_and_reset_brings_the_seed_back(erp):
    erp.set_erp_volume("2026-11-03", 57)
    ids = [item["id"] for item in erp.erp_window_state(DAY_FROM, DAY_TO)]
    assert sorted(ids) == [f"WO-20261103-{number:06d}" for number in range(57)]
    erp.set_erp_volume("2026-11-03", 0)
    assert erp.erp_window_state(DAY_FROM, DAY_TO) == []
    erp.reset_erp()
    seeded = erp.erp_window_state(*THREE_DAYS)
    erp.reset_erp(seed=2)
    assert erp.erp_window_state(*THREE_DAYS) != seeded
    erp.reset_erp()
    assert erp.erp_window_state(*THREE_DAYS) == seeded


def test_bounds_are_inclusive_then_exclusive_and_offsets_name_the_same_instants(erp, api):
    truth = erp.erp_window_state(DAY_FROM, DAY_TO)
    boundary = truth[10]["updated_at"]
    as_utc = datetime.fromisoformat(boundary).astimezone(UTC).isoformat()
    before = erp.erp_window_state(DAY_FROM, boundary)
    after = flat(read_window(api, as_utc, DAY_TO, page_size=3))
    assert boundary not in {item["updated_at"] for item in before}
    assert after[0]["updated_at"] == boundary
    assert before + after == truth
    for bounds in (("2026-11-02T21:00:00Z", "2026-11-03T21:00:00Z"),
                   ("2026-11-03T02:00:00+05:00", "2026-11-04T02:00:00+05:00"),
                   ("2026-11-02T21:00:00+00:00", "2026-11-03T13:00:00-08:00")):
        assert flat(read_window(api, *bounds, page_size=5)) == truth
        assert erp.erp_window_state(*bounds) == truth
    half = ("2026-11-03T12:00:00+03:00", "2026-11-03T09:00:00Z")
    assert erp.erp_window_state(DAY_FROM, half[0]) == erp.erp_window_state(DAY_FROM, half[1])


def test_a_late_update_moves_the_record_to_its_new_window(erp, api):
    old_window = ("2026-10-06T00:00:00+03:00", "2026-10-07T00:00:00+03:00")
    before = live(erp.erp_window_state(*old_window))[4]
    changed = erp.update_erp_work_order(before["id"], "2026-11-03T10:15:00.25+03:00",
                                        status="done", amount="1234567.89")
    assert changed == {**before, "status": "done", "amount": "1234567.89",
                       "updated_at": "2026-11-03T10:15:00.250000+03:00",
                       "version": changed["version"]}
    assert changed["version"] > before["version"]
    assert before["id"] not in {item["id"] for item in flat(read_window(api, *old_window))}
    served = flat(read_window(api, DAY_FROM, DAY_TO, page_size=10))
    assert [item for item in served if item["id"] == before["id"]] == [changed]
    assert served == erp.erp_window_state(DAY_FROM, DAY_TO)
    again = erp.update_erp_work_order(before["id"], "2026-11-04T08:00:00Z", title="Новый заголовок")
    assert again["title"] == "Новый заголовок" and again["status"] == "done"
    assert before["id"] not in {item["id"] for item in erp.erp_window_state(DAY_FROM, DAY_TO)}
    assert again in erp.erp_window_state("2026-11-04T00:00:00+03:00", "2026-11-05T00:00:00+03:00")


def test_changed_records_sharing_a_batch_stamp_are_ordered_by_id(erp, api):
    stamp = "2026-11-03T23:30:00.000000+03:00"  # a nightly import's
    erp.set_erp_volume("2026-11-03", 300)
    truth = erp.erp_window_state(DAY_FROM, DAY_TO)
    assert sum(item["updated_at"] == stamp for item in truth) >= 5
    older_day = live(erp.erp_window_state("2026-10-06T00:00+03:00", "2026-10-07T00:00+03:00"))[0]
    same_day = next(item for item in live(truth) if item["updated_at"] < "2026-11-03T08")
    for record in (older_day, same_day):
        erp.update_erp_work_order(record["id"], stamp)
    truth = erp.erp_window_state(DAY_FROM, DAY_TO)
    run = [item["id"] for item in truth if item["updated_at"] == stamp]
    assert run == sorted(run) and older_day["id"] == run[0] and same_day["id"] in run[1:]
    for page_size in (1, 2):
        assert flat(read_window(api, DAY_FROM, DAY_TO, page_size=page_size)) == truth


def test_pages_match_the_oracle_after_many_random_changes(erp, api):
    window = ("2026-11-01T00:00:00+03:00", "2026-11-06T00:00:00+03:00")
    current = {item["id"]: item for item in erp.erp_window_state(*window)}
    stamps = sorted({item["updated_at"] for item in current.values()}, key=datetime.fromisoformat)
    rng = random.Random(7)
    changes = []
    for _ in range(120):
        record = current[rng.choice(sorted(current))]
        now = datetime.fromisoformat(record["updated_at"])
        later = [s for s in stamps if datetime.fromisoformat(s) > now]
        if later and rng.random() < 0.5:  # land on another record's instant: a tie
            updated_at = rng.choice(later)
        else:
            updated_at = (now + timedelta(seconds=rng.uniform(1e-6, 4 * 86400))).isoformat()
        op = "restore" if record["deleted"] else rng.choice(["update", "update", "delete"])
        change = {"op": op, "id": record["id"], "updated_at": updated_at}
        if op != "delete":
            change["status"] = rng.choice(sorted(STATUSES))
        changes.append(change)
        current[record["id"]] = {**record, "updated_at": updated_at, "deleted": op == "delete"}
    erp.change_erp_work_orders(changes)
    truth = erp.erp_window_state(*window)
    for page_size in (1, 4, 100):
        assert flat(read_window(api, *window, page_size=page_size)) == truth
    assert [key(item) for item in truth] == sorted(key(item) for item in truth)


def test_tombstones_appear_in_the_window_of_their_deletion_and_restore_is_newer(erp, api):
    record = live(erp.erp_window_state(DAY_FROM, DAY_TO))[0]
    deleted = erp.delete_erp_work_order(record["id"], "2026-11-03T23:59:59.999999+03:00")
    assert deleted == {**record, "deleted": True, "updated_at": deleted["updated_at"],
                       "version": deleted["version"]}
    assert flat(read_window(api, DAY_FROM, DAY_TO))[-1] == deleted
    with pytest.raises(httpx.HTTPStatusError) as refused:
        erp.update_erp_work_order(record["id"], "2026-11-04T01:00:00+03:00", status="done")
    assert status_of(refused) == 409
    restored = erp.restore_erp_work_order(record["id"], "2026-11-04T09:00:00+03:00")
    assert restored["deleted"] is False and restored["version"] > deleted["version"]
    assert record["id"] not in {item["id"] for item in flat(read_window(api, DAY_FROM, DAY_TO))}
    assert restored in flat(read_window(api, "2026-11-04T00:00:00+03:00", "2026-11-05T00:00Z"))


def test_changes_are_checked_and_applied_all_or_none(erp):
    first, second = live(erp.erp_window_state(DAY_FROM, DAY_TO))[:2]
    cases = {
        404: [{"op": "update", "id": "WO-20261103-999999", "updated_at": "2026-11-05T00:00Z"}],
        409: [{"op": "update", "id": first["id"], "updated_at": first["updated_at"]}],
        400: [{"op": "update", "id": first["id"], "updated_at": "2026-11-05T00:00Z",
               "status": "archived"}],
    }
    for status, changes in cases.items():
        with pytest.raises(httpx.HTTPStatusError) as refused:
            erp.change_erp_work_orders(changes)
        assert status_of(refused) == status
    with pytest.raises(httpx.HTTPStatusError) as refused:
        erp.change_erp_work_orders([
            {"op": "update", "id": second["id"], "updated_at": "2026-11-05T00:00Z"},
            {"op": "restore", "id": first["id"], "updated_at": "2026-11-05T00:00Z"},
        ])
    assert status_of(refused) == 409
    assert live(erp.erp_window_state(DAY_FROM, DAY_TO))[:2] == [first, second]


def test_versions_beyond_2_31_are_exact_and_only_grow(erp, api):
    assert all(item["version"] > 2**31 for item in erp.erp_window_state(DAY_FROM, DAY_TO))
    record = live(erp.erp_window_state(DAY_FROM, DAY_TO))[0]
    forced = erp.update_erp_work_order(record["id"], "2026-11-03T23:00:00+03:00",
                                       version=2**53 + 1)  # not a float64: must stay exact
    assert forced["version"] == 2**53 + 1
    assert [item["version"] for item in flat(read_window(api, DAY_FROM, DAY_TO))
            if item["id"] == record["id"]] == [2**53 + 1]
    assert erp.update_erp_work_order(record["id"], "2026-11-03T23:30:00+03:00")["version"] == (
        2**53 + 2)
    with pytest.raises(httpx.HTTPStatusError) as refused:
        erp.update_erp_work_order(record["id"], "2026-11-03T23:45:00+03:00", version=2**40)
    assert status_of(refused) == 409


def test_keyset_pages_stay_stable_when_records_change_between_pages(erp, api):
    truth = erp.erp_window_state(*THREE_DAYS)
    body = first_page(api, *THREE_DAYS, page_size=10).json()
    served = list(body["items"])
    seen, ahead, moved_out = live(served)[3], live(truth)[40], live(truth)[50]
    erp.update_erp_work_order(seen["id"], "2026-11-04T12:00:00+03:00", status="done")
    erp.update_erp_work_order(ahead["id"], "2026-11-04T12:00:01+03:00", status="cancelled")
    erp.update_erp_work_order(moved_out["id"], "2026-11-06T12:00:00+03:00")
    while body["next_page_token"] is not None:
        body = next_page(api, body["next_page_token"]).raise_for_status().json()
        served.extend(body["items"])
    latest = {item["id"]: item for item in served}  # later items are newer versions
    assert sorted(latest.values(), key=key) == erp.erp_window_state(*THREE_DAYS)
    ids = [item["id"] for item in served]
    assert ids.count(seen["id"]) == 2  # moved past the cursor: served again, as keysets do
    assert ids.count(ahead["id"]) == 1 and moved_out["id"] not in ids
    assert len(ids) == len(truth)  # one record served twice, one moved out


def test_expired_and_unknown_page_tokens_answer_410(erp, api):
    token = first_page(api, DAY_FROM, DAY_TO, page_size=5).json()["next_page_token"]
    assert next_page(api, token).status_code == 200
    erp.set_erp_page_token_ttl(0)
    expired = next_page(api, token)
    assert expired.status_code == 410
    assert expired.json()["error"] == "page_token_expired"
    erp.set_erp_page_token_ttl(600)
    assert next_page(api, token).status_code == 200
    erp.expire_erp_page_tokens()
    assert next_page(api, token).status_code == 410
    fresh = first_page(api, DAY_FROM, DAY_TO, page_size=5).json()["next_page_token"]
    assert next_page(api, fresh).status_code == 200
    tampered = fresh[:-3] + ("AAA" if fresh[-3:] != "AAA" else "BBB")
    for unknown in ("not-a-token", tampered):
        assert next_page(api, unknown).status_code == 410


def test_a_token_continues_only_its_own_query(erp, api):
    token = first_page(api, DAY_FROM, DAY_TO, page_size=5).json()["next_page_token"]
    same = {"page_token": token, "updated_from": "2026-11-02T21:00:00Z", "page_size": 5}
    assert api.get("/work-orders", params=same).status_code == 200
    for other in ({"updated_to": "2026-11-05T00:00:00Z"}, {"page_size": 6}):
        refused = api.get("/work-orders", params={"page_token": token, **other})
        assert refused.status_code == 400


def test_bad_windows_answer_400(erp, api):
    base = f"/work-orders?updated_to={DAY_TO.replace('+', '%2B')}"
    unencoded_plus = api.get(f"{base}&updated_from=2026-11-03T00:00:00+03:00")
    assert unencoded_plus.status_code == 400 and "%2B" in unencoded_plus.json()["message"]
    for bad in ({"updated_from": "2026-11-03T00:00:00", "updated_to": DAY_TO},
                {"updated_to": DAY_TO},
                {"updated_from": DAY_TO, "updated_to": DAY_FROM},
                {"updated_from": DAY_FROM, "updated_to": DAY_TO, "page_size": 0},
                {"updated_from": DAY_FROM, "updated_to": DAY_TO, "page_size": 1001}):
        response = api.get("/work-orders", params=bad)
        assert response.status_code == 400 and response.json()["error"] == "bad_request"


def test_a_fault_hits_only_the_kth_page_of_a_window(erp, api):
    erp.fault("status", route="erp", page=3, status=503)
    body = first_page(api, DAY_FROM, DAY_TO, page_size=5).json()
    body = next_page(api, body["next_page_token"]).json()
    failed = next_page(api, body["next_page_token"])
    assert failed.status_code == 503
    assert next_page(api, body["next_page_token"]).status_code == 200  # the retry passes
    served = erp.requests("erp")
    assert [(r["page"], r["status"], r["fault"]) for r in served] == [
        (1, 200, None), (2, 200, None), (3, 503, "status"), (3, 200, None)]


def test_429_with_retry_after_on_page_k_of_the_matching_window_only(erp, api):
    next_day = ("2026-11-04T00:00:00+03:00", "2026-11-05T00:00:00+03:00")
    erp.fault("status", route="erp", page=2, status=429, retry_after=7,
              match="updated_from=2026-11-04")
    token = first_page(api, DAY_FROM, DAY_TO, page_size=5).json()["next_page_token"]
    assert next_page(api, token).status_code == 200  # another window's page 2
    token = first_page(api, *next_day, page_size=5).json()["next_page_token"]
    limited = next_page(api, token)
    assert limited.status_code == 429 and limited.headers["Retry-After"] == "7"
    assert next_page(api, token).status_code == 200


def test_an_expire_token_fault_expires_the_kth_pages_token_for_good(erp, api):
    erp.fault("expire_token", route="erp", page=2)
    token = first_page(api, DAY_FROM, DAY_TO, page_size=5).json()["next_page_token"]
    assert next_page(api, token).status_code == 410
    assert next_page(api, token).status_code == 410  # a retry does not revive it
    assert flat(read_window(api, DAY_FROM, DAY_TO, page_size=5)) == erp.erp_window_state(
        DAY_FROM, DAY_TO)  # starting the window again works
    with pytest.raises(httpx.HTTPStatusError):
        erp.fault("expire_token", route="erp", page=1)  # page 1 carries no token


def test_hang_and_drop_faults_on_a_page(erp, api):
    token = first_page(api, DAY_FROM, DAY_TO, page_size=5).json()["next_page_token"]
    erp.fault("drop", route="erp", page=2)
    with pytest.raises(httpx.RemoteProtocolError):
        next_page(api, token)
    erp.fault("hang", route="erp", page=2, seconds=1)
    with pytest.raises(httpx.ReadTimeout):
        next_page(api, token, timeout=0.2)
    assert next_page(api, token).status_code == 200


def test_a_configured_bearer_token_is_required(erp, api):
    erp.set_erp_token("s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
        refused = first_page(api, DAY_FROM, DAY_TO, headers=headers)
        assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
    allowed = first_page(api, DAY_FROM, DAY_TO, page_size=5,
                         headers={"Authorization": "Bearer s3cret"})
    assert allowed.status_code == 200
    assert next_page(api, allowed.json()["next_page_token"]).status_code == 401
    erp.set_erp_token(None)
    assert first_page(api, DAY_FROM, DAY_TO).status_code == 200


def test_a_bearer_token_given_at_start_survives_reset():
    server = StandinServer(erp_token="from-start").start()
    try:
        StandinClient(server.url).reset_erp()
        with httpx.Client(base_url=f"{server.erp_url}/api/v1") as own_api:
            assert first_page(own_api, DAY_FROM, DAY_TO).status_code == 401
            authorized = first_page(own_api, DAY_FROM, DAY_TO,
                                    headers={"Authorization": "Bearer from-start"})
            assert authorized.status_code == 200
    finally:
        server.stop()


def test_a_100k_record_window_is_served_in_1000_pages(erp, api):
    erp.set_erp_volume("2026-11-17", 100_000)
    pages = read_window(api, "2026-11-17T00:00:00+03:00", "2026-11-18T00:00:00+03:00")
    assert len(pages) == 1000 and {len(page) for page in pages} == {100}
    items = flat(pages)
    assert sorted(item["id"] for item in items) == [
        f"WO-20261117-{number:06d}" for number in range(100_000)]
    assert [key(item) for item in items] == sorted(key(item) for item in items)
