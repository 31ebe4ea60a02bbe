"""Liveness, readiness and status over real HTTP on 127.0.0.1 (RFC §8 standby, §12 readiness)."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from apsup.observability.health import HealthServer, Heartbeat, fan_in
from apsup.observability.status import (
    CHECK_NAME,
    FamilyStatus,
    StatusSnapshot,
    SupervisorStatus,
    combine,
    evaluate_readiness,
)

LIVENESS = 30.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def family(status: str = "ok", reason: str | None = None) -> FamilyStatus:
    return {
        "status": status,  # type: ignore[typeddict-item]
        "reason": reason,
        "budget": 4,
        "running": 1,
        "ready": 2,
        "retry_wait": 0,
        "next_retry_at": None,
        "due_at": "2026-01-01T00:05:00+00:00",
        "unacknowledged": 0,
    }


def supervisor(
    key: str = "global",
    leader: bool = True,
    lease_error: str | None = None,
    families: dict[str, FamilyStatus] | None = None,
) -> SupervisorStatus:
    sup: SupervisorStatus = {
        "key": key,
        "leader": leader,
        "holder": "host-a",
        "generation": 7,
        "families": families or {"topic-memory": family()},
    }
    if lease_error is not None:
        sup["lease_error"] = lease_error
    return sup


def snapshot(*sups: SupervisorStatus, role: str = "all", mode: str = "global") -> StatusSnapshot:
    return {"role": role, "mode": mode, "supervisors": list(sups), "heartbeat_age": None}


class Holder:
    """A mutable StatusProvider: tests swap the snapshot the loop would publish."""

    def __init__(self, snap: StatusSnapshot) -> None:
        self.snap = snap
        self.fail = False

    def __call__(self) -> StatusSnapshot:
        if self.fail:
            raise RuntimeError("provider broke: mysql://u:hunter2@db/x")
        return self.snap


def get(port: int, path: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, orjson.loads(body) if body else None
    finally:
        conn.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def served(clock: FakeClock) -> Iterator[tuple[HealthServer, Holder]]:
    holder = Holder(snapshot(supervisor()))
    server = HealthServer(
        status=holder, heartbeat=Heartbeat(clock), liveness_timeout=LIVENESS, port=0
    )
    server.start()
    yield server, holder
    server.stop()


def test_binds_loopback_by_default(served) -> None:
    server, _ = served
    assert server.address[0] == "127.0.0.1"
    assert server._httpd is not None
    assert server._httpd.socket.getsockname()[0] == "127.0.0.1"
    assert server._httpd.socket.family == socket.AF_INET


def test_one_family_degraded_under_valid_lease_is_partial(served) -> None:
    server, holder = served
    holder.snap = snapshot(
        supervisor(
            families={
                "topic-memory": family(),
                "experience": family("degraded", "discovery failed: OperationalError"),
                "profile": family("disabled", "automatic admission disabled"),
            }
        )
    )
    code, body = get(server.port, "/readyz")
    assert code == 200
    assert body["check"] == CHECK_NAME and body["status"] == "degraded"
    assert body["families"]["experience"] == {
        "status": "degraded",
        "reason": "discovery failed: OperationalError",
        "supervisor_key": "global",
    }
    assert body["families"]["topic-memory"]["status"] == "ok"
    assert body["families"]["profile"]["status"] == "disabled"
    assert "experience" in body["reason"]


def test_healthy_leader_is_ok(served) -> None:
    server, _ = served
    code, body = get(server.port, "/readyz")
    assert (code, body["status"], body["reason"]) == (200, "ok", None)


def test_standby_is_ready_as_standby(served) -> None:
    server, holder = served
    holder.snap = snapshot(supervisor(leader=False), role="background")
    code, body = get(server.port, "/readyz")
    assert (code, body["status"]) == (200, "standby")


def test_lease_lost_is_down(served) -> None:
    server, holder = served
    holder.snap = snapshot(supervisor(leader=False, lease_error="renewal failed: timeout"))
    code, body = get(server.port, "/readyz")
    assert (code, body["status"]) == (503, "down")
    assert "renewal failed" in body["reason"]


def test_failing_provider_is_down_and_redacted(served) -> None:
    server, holder = served
    holder.fail = True
    code, body = get(server.port, "/readyz")
    assert (code, body["status"]) == (503, "down")
    assert "hunter2" not in body["reason"]
    assert get(server.port, "/status")[0] == 503


def test_stale_heartbeat_fails_liveness_and_readiness(served, clock: FakeClock) -> None:
    server, _ = served
    assert get(server.port, "/healthz")[0] == 200
    clock.now += LIVENESS + 1
    code, body = get(server.port, "/healthz")
    assert (code, body["status"]) == (503, "down")
    code, body = get(server.port, "/readyz")
    assert (code, body["status"]) == (503, "down")
    assert server.heartbeat is not None
    server.heartbeat.beat()
    assert get(server.port, "/healthz")[0] == 200


def test_status_serves_the_snapshot_with_heartbeat_age(served, clock: FakeClock) -> None:
    server, holder = served
    clock.now += 2.5
    code, body = get(server.port, "/status")
    assert code == 200
    assert body["supervisors"] == holder.snap["supervisors"]
    assert body["heartbeat_age"] == 2.5 and body["role"] == "all"


def test_unknown_path_and_missing_parts_are_404(served) -> None:
    server, _ = served
    assert get(server.port, "/nope")[0] == 404
    assert get(server.port, "/metrics")[0] == 404  # no registry given to this server


def test_stop_releases_the_thread(clock: FakeClock) -> None:
    server = HealthServer(heartbeat=Heartbeat(clock))
    server.start()
    thread = server._thread
    assert thread is not None and thread.is_alive()
    server.stop()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError):
        _ = server.port


def test_fan_in_merges_dedicated_children(clock: FakeClock) -> None:
    """The launcher's single probe covers every per-Family Supervisor process."""
    a = Holder(snapshot(supervisor("artifact:a", families={"a": family()}), mode="dedicated"))
    b = Holder(
        snapshot(supervisor("artifact:b", False, families={"b": family()}), mode="dedicated")
    )
    for h in (a, b):
        h.snap["heartbeat_age"] = 0.0
    with (
        HealthServer(status=a, heartbeat=Heartbeat(clock)) as sa,
        HealthServer(status=b, heartbeat=Heartbeat(clock)) as sb,
    ):
        urls = [f"http://127.0.0.1:{sa.port}", f"http://127.0.0.1:{sb.port}"]
        with HealthServer(status=fan_in(urls), heartbeat=Heartbeat(clock)) as launcher:
            code, body = get(launcher.port, "/readyz")
            assert (code, body["status"]) == (200, "ok")  # leader of a, standby for b
            assert set(body["families"]) == {"a", "b"}
            assert body["mode"] == "dedicated"
            clock.now += LIVENESS + 1  # children's loops stall; the launcher keeps beating
            assert launcher.heartbeat is not None
            launcher.heartbeat.beat()
            code, body = get(launcher.port, "/readyz")
            assert (code, body["status"]) == (503, "down")
    # a child that does not answer at all: down for that child, degraded overall
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"  # bound, not listening: refused
    try:
        with (
            HealthServer(status=a, heartbeat=Heartbeat(clock)) as sa,
            HealthServer(
                status=fan_in([f"http://127.0.0.1:{sa.port}", dead_url]),
                heartbeat=Heartbeat(clock),
            ) as launcher,
        ):
            a.snap["heartbeat_age"] = 0.0
            code, body = get(launcher.port, "/readyz")
            assert (code, body["status"]) == (200, "degraded")
            assert any(s["key"].startswith("unreachable:") for s in body["supervisors"])
    finally:
        dead.close()


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([], "ok"),
        (["ok", "standby"], "ok"),
        (["standby", "standby"], "standby"),
        (["ok", "degraded"], "degraded"),
        (["ok", "down"], "degraded"),
        (["down", "down"], "down"),
    ],
)
def test_combine(states: list[Any], expected: str) -> None:
    assert combine(states) == expected


def test_readiness_without_supervisors_depends_on_role() -> None:
    api = evaluate_readiness(snapshot(role="api"), heartbeat_age=0.0, liveness_timeout=LIVENESS)
    bg = evaluate_readiness(
        snapshot(role="background"), heartbeat_age=0.0, liveness_timeout=LIVENESS
    )
    assert (api["status"], bg["status"]) == ("ok", "down")
