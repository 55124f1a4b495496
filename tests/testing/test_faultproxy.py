"""The fault-injection proxy: each fault kind on the wire, what it records, rates, holds, seeds."""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator

import fsspec
import pytest

from gradpipe.testing.faultproxy import KINDS, FaultProxy, InjectedFault
from gradpipe.testing.s3server import S3Server

pytestmark = pytest.mark.s3

BUCKET = "gradpipe-test"


@pytest.fixture
def server(s3: S3Server) -> S3Server:
    return s3


@pytest.fixture
def proxy(server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(server.endpoint_url, seed=11) as proxy:
        yield proxy


def direct(server: S3Server) -> fsspec.AbstractFileSystem:
    return fsspec.filesystem("s3", skip_instance_cache=True, **server.storage_options)


def request(
    proxy: FaultProxy, method: str, key: str, body: bytes | None = None, **headers: str
) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP request through the proxy (no client retries in the way)."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        conn.request(method, f"/{BUCKET}/{key}", body=body, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_without_rates_every_request_is_forwarded_and_counted(
    server: S3Server, proxy: FaultProxy
) -> None:
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **proxy.storage_options)
    fs.pipe(f"{BUCKET}/a/x", b"12345")
    assert fs.cat(f"{BUCKET}/a/x") == b"12345"
    fs.info(f"{BUCKET}/a/x")
    fs.copy(f"{BUCKET}/a/x", f"{BUCKET}/a/y")
    fs.invalidate_cache()
    assert fs.find(f"{BUCKET}/a") == [f"{BUCKET}/a/x", f"{BUCKET}/a/y"]
    fs.rm([f"{BUCKET}/a/x"])
    status, _, _ = request(proxy, "PUT", "a/c", b"new", **{"If-None-Match": "*"})
    assert status == 200
    assert direct(server).cat(f"{BUCKET}/a/c") == b"new"
    assert proxy.injected == []
    counted = proxy.requests
    assert counted["PUT"] >= 1
    assert counted["GET"] == 1
    assert counted["HEAD"] >= 1
    assert counted["COPY"] == 1
    assert counted["LIST"] >= 1
    assert counted["DELETE"] == 1  # a bulk delete
    assert counted["CPUT"] == 1


# kind -> (the status the client sees, or None for a reset connection; did the PUT land?)
ON_PUT = {
    "500": (500, True),
    "502": (502, False),
    "503": (503, False),
    "slow": (200, True),
    "reset": (None, False),
    "drop": (None, True),
}


@pytest.mark.parametrize("kind", sorted(ON_PUT), ids=lambda kind: f"fault-{kind}")
def test_each_fault_on_a_conditional_put(server: S3Server, proxy: FaultProxy, kind: str) -> None:
    want_status, lands = ON_PUT[kind]
    proxy.delay = (0.01, 0.02)
    proxy.set_rates({kind: {"CPUT": 1.0}})
    if want_status is None:
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            request(proxy, "PUT", "k", b"data", **{"If-None-Match": "*"})
    else:
        status, headers, body = request(proxy, "PUT", "k", b"data", **{"If-None-Match": "*"})
        assert status == want_status
        if status >= 500:
            # S3's own error document, which botocore parses and retries.
            code = {500: "InternalError", 502: "BadGateway", 503: "SlowDown"}[status]
            assert f"<Code>{code}</Code>".encode() in body
            assert headers["Content-Type"] == "application/xml"
    assert direct(server).exists(f"{BUCKET}/k") is lands
    assert proxy.injected == [InjectedFault(kind, "CPUT", f"{BUCKET}/k")]
    # Other operations are untouched.
    status, _, _ = request(proxy, "PUT", "plain", b"x")
    assert status == 200
    assert proxy.total == 1


def test_truncated_reply_keeps_the_length_and_cuts_the_body(
    server: S3Server, proxy: FaultProxy
) -> None:
    # Readable without a signature, for the raw request below.
    direct(server).pipe(f"{BUCKET}/big", b"0123456789" * 100, ACL="public-read")
    proxy.set_rates({"truncate": 1.0})
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    conn.request("GET", f"/{BUCKET}/big")
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("Content-Length") == "1000"
    with pytest.raises(http.client.IncompleteRead) as caught:
        response.read()
    assert len(caught.value.partial) == 500
    conn.close()
    # A PUT has no reply body to cut: a float rate applies to GET and LIST only.
    status, _, _ = request(proxy, "PUT", "other", b"x")
    assert status == 200
    assert proxy.injected == [InjectedFault("truncate", "GET", f"{BUCKET}/big")]


def test_rates_are_checked() -> None:
    proxy = FaultProxy("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="unknown fault kind"):
        proxy.set_rates({"lost": 0.1})
    with pytest.raises(ValueError, match="unknown operation"):
        proxy.set_rates({"500": {"PATCH": 0.1}})
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        proxy.set_rates({"500": -0.1})
    with pytest.raises(ValueError, match="add up to"):
        proxy.set_rates({"500": 0.6, "drop": {"GET": 0.5}})
    proxy.set_rates({"500": 0.6, "drop": {"PUT": 0.4}})  # 1.0 on PUT is allowed
    with pytest.raises(ValueError, match="http://host:port"):
        FaultProxy("s3://bucket")
    assert set(KINDS) == {"500", "502", "503", "slow", "reset", "truncate", "drop"}


def _faults_of(server: S3Server, seed: int) -> list[InjectedFault]:
    with FaultProxy(server.endpoint_url, seed=seed, rates={"503": 0.3, "500": 0.2}) as proxy:
        for i in range(40):
            request(proxy, "PUT", f"seeded/{i}", b"x")
        return proxy.injected


def test_the_seed_decides_which_requests_fail(server: S3Server) -> None:
    first = _faults_of(server, 5)
    assert 5 < len(first) < 35
    assert _faults_of(server, 5) == first
    assert _faults_of(server, 6) != first


def test_paused_injects_nothing(proxy: FaultProxy) -> None:
    proxy.set_rates({"503": 1.0})
    with proxy.paused():
        assert request(proxy, "PUT", "p", b"x")[0] == 200
    assert request(proxy, "PUT", "p", b"x")[0] == 503
    assert proxy.counts() == {"503": 1}
    assert proxy.counts_by_operation() == {("503", "PUT"): 1}


@pytest.mark.parametrize("land", [True, False])
def test_hold_stops_a_request_before_or_after_it_lands(
    server: S3Server, proxy: FaultProxy, land: bool
) -> None:
    held = proxy.hold("CPUT", f"{BUCKET}/refs/*", land=land)
    assert request(proxy, "PUT", "refs/other", b"x")[0] == 200  # not conditional: not held
    outcome: list[object] = []

    def client() -> None:
        try:
            outcome.append(request(proxy, "PUT", "refs/r", b"v", **{"If-None-Match": "*"})[0])
        except (ConnectionError, http.client.HTTPException) as exc:
            outcome.append(exc)

    thread = threading.Thread(target=client)
    thread.start()
    assert held.arrived.wait(30)
    assert direct(server).exists(f"{BUCKET}/refs/r") is land
    assert not outcome  # the client is still waiting
    held.release()
    thread.join(30)
    assert outcome == [200] if land else isinstance(outcome[0], Exception)
    assert direct(server).exists(f"{BUCKET}/refs/r") is land
    assert held.fault == InjectedFault("hold", "CPUT", f"{BUCKET}/refs/r")
    # One request only: the next one goes through.
    assert request(proxy, "PUT", "refs/r2", b"v", **{"If-None-Match": "*"})[0] == 200
