"""A loopback HTTP proxy in front of an S3 server that injects faults, for tests and benchmarks.

:class:`FaultProxy` listens on ``http://127.0.0.1:<port>``, forwards every
request to the S3 server behind it (moto's, :class:`~gradpipe.testing.s3server.S3Server`)
and, at seeded random with a rate per fault kind and S3 operation, answers
it the way a flaky network or a busy S3 would:

===============  ==========================================  ==========================
kind             what the client gets                        did the request land?
===============  ==========================================  ==========================
``500``          500 ``InternalError`` (S3's XML error)      yes: forwarded first
``502``          502 ``BadGateway``                          no
``503``          503 ``SlowDown``                            no
``slow``         the real reply, after a delay               yes
``reset``        the connection reset (TCP RST)              no
``truncate``     the real status and ``Content-Length``,     yes
                 half the body, then the connection closed
``drop``         the connection reset instead of the reply   yes: forwarded first
===============  ==========================================  ==========================

botocore retries the 5xx replies (its standard retry mode classes 500, 502
and 503 as transient and ``SlowDown`` as throttling) and the resets; a
retried conditional PUT whose first attempt landed (``500``, ``drop``) then
gets a 412 for its own write, which gradpipe must recognise. Truncated
bodies are only injected on replies that have one (GET, LIST).

Operations are those of :data:`OPERATIONS`: ``GET`` (an object), ``LIST``,
``HEAD``, ``PUT`` (plain), ``CPUT`` (a conditional PUT: ``If-None-Match``
or ``If-Match``, as gradpipe writes blocks and refs), ``COPY``, ``DELETE``
(bulk deletes too) and ``POST``. Rates are given per kind, for every
operation or per operation::

    proxy = FaultProxy(server.endpoint_url, seed=7, rates={
        "503": 0.01,                           # 1% of every request
        "drop": {"CPUT": 0.05, "PUT": 0.02},   # conditional PUTs lose 5% of their replies
    })
    with proxy:
        store = gp.open_store("s3://bucket/x", mode="a", storage_options=proxy.storage_options)
        ...
    proxy.counts()          # Counter({"503": 31, "drop": 12, ...})

Every fault injected is recorded (:attr:`FaultProxy.injected`: kind,
operation, ``bucket/key``), so a test or a benchmark counts what it
survived. ``with proxy.paused():`` forwards everything untouched (set-up,
checks); :meth:`FaultProxy.hold` stops one chosen request mid-flight, so a
test can kill its client there (before or after it lands).
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

__all__ = ["KINDS", "OPERATIONS", "FaultProxy", "Hold", "InjectedFault", "Rates"]

#: Fault kinds, in the order a request's one random draw is laid out over them.
KINDS: Final = ("500", "502", "503", "slow", "reset", "truncate", "drop")
#: S3 operations, as the proxy tells them apart.
OPERATIONS: Final = ("GET", "LIST", "HEAD", "PUT", "CPUT", "COPY", "DELETE", "POST")
#: Kind -> rate for every operation, or kind -> {operation: rate}.
Rates = Mapping[str, float | Mapping[str, float]]

# Replies with a body to cut short; a HEAD or an empty 200 has none.
_TRUNCATABLE: Final = frozenset({"GET", "LIST"})
_ERRORS: Final = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "502": (502, "BadGateway", "The gateway could not reach the service."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
}
_HOP_BY_HOP: Final = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding"}
    | {"upgrade"}
)


@dataclass(frozen=True)
class InjectedFault:
    """One fault the proxy injected: its kind, the S3 operation and ``bucket/key``."""

    kind: str
    operation: str
    key: str


@dataclass
class Hold:
    """A request stopped mid-flight by :meth:`FaultProxy.hold`.

    ``arrived`` is set when the first matching request reaches the proxy (with
    ``land=True`` after it was forwarded, so it has landed); the request then
    waits until :meth:`release`. Its client gets the reply only if still there;
    with ``land=False`` the request is never forwarded and its connection is reset.
    """

    operation: str
    key: str
    land: bool
    arrived: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    fault: InjectedFault | None = None

    def release(self) -> None:
        """Let the held request go on."""
        self.released.set()


class FaultProxy:
    """A fault-injecting proxy on loopback in front of ``upstream``; a context manager.

    Parameters
    ----------
    upstream : str
        The S3 server's ``http://host:port``.
    seed : int
        Seeds the random draws (one per request; with concurrent clients the
        order of requests, and so which one a draw falls on, may vary).
    rates : mapping, optional
        Probability of each kind of :data:`KINDS`, per request: a float for
        every operation the kind applies to, or ``{operation: rate}``. The
        rates of one operation must add up to at most 1. None: no faults.
    delay : (float, float)
        Bounds of the uniform random delay of a ``slow`` reply, in seconds.
    port : int
        0 picks a free port.
    """

    def __init__(
        self,
        upstream: str,
        *,
        seed: int = 0,
        rates: Rates | None = None,
        delay: tuple[float, float] = (0.05, 0.25),
        port: int = 0,
    ) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"upstream must be an http://host:port URL, not {upstream!r}")
        self.upstream = (parsed.hostname, parsed.port or 80)
        self.delay = delay
        self.injected: list[InjectedFault] = []
        self.requests: Counter[str] = Counter()  # by operation, every request received
        self._port = port
        self._random = random.Random(seed)  # noqa: S311 (reproducible faults, not secrets)
        self._table: dict[str, list[tuple[str, float]]] = {}
        self._paused = 0
        self._holds: list[Hold] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.set_rates(rates or {})

    # --- configuration -----------------------------------------------------------
    def set_rates(self, rates: Rates) -> None:
        """Replace the fault rates (see the class docstring)."""
        table: dict[str, list[tuple[str, float]]] = {op: [] for op in OPERATIONS}
        for kind, rate in rates.items():
            if kind not in KINDS:
                raise ValueError(f"unknown fault kind {kind!r}; kinds are {', '.join(KINDS)}")
            by_op = rate if isinstance(rate, Mapping) else dict.fromkeys(OPERATIONS, rate)
            for op, value in by_op.items():
                if op not in OPERATIONS:
                    raise ValueError(f"unknown operation {op!r}; operations: {OPERATIONS}")
                if not 0 <= value <= 1:
                    raise ValueError(f"rate of {kind!r} on {op} must be in [0, 1], not {value}")
                if kind == "truncate" and op not in _TRUNCATABLE:
                    continue  # no body to cut short
                if value:
                    table[op].append((kind, float(value)))
        for op, kinds in table.items():
            total = sum(r for _, r in kinds)
            if total > 1:
                raise ValueError(f"the fault rates of {op} add up to {total:.3f} > 1")
            kinds.sort(key=lambda kr: KINDS.index(kr[0]))
        with self._lock:
            self._table = table

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Inject nothing inside the ``with`` block (holds still apply)."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1

    def hold(self, operation: str, key: str = "*", *, land: bool = True) -> Hold:
        """Stop the next request of ``operation`` whose ``bucket/key`` matches ``key``.

        ``key`` is an :func:`fnmatch.fnmatchcase` pattern (``*`` crosses ``/``).
        The returned :class:`Hold` says when it arrived; :meth:`Hold.release`
        lets it go on. Counted in :attr:`injected` as kind ``hold``.
        """
        if operation not in OPERATIONS:
            raise ValueError(f"unknown operation {operation!r}; operations: {OPERATIONS}")
        held = Hold(operation, key, land)
        with self._lock:
            self._holds.append(held)
        return held

    # --- what happened -------------------------------------------------------------
    def counts(self) -> Counter[str]:
        """Faults injected so far, by kind."""
        with self._lock:
            return Counter(f.kind for f in self.injected)

    def counts_by_operation(self) -> Counter[tuple[str, str]]:
        """Faults injected so far, by (kind, operation)."""
        with self._lock:
            return Counter((f.kind, f.operation) for f in self.injected)

    @property
    def total(self) -> int:
        """Faults injected so far."""
        with self._lock:
            return len(self.injected)

    # --- serving ---------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        return int(self._server.server_address[1])

    @property
    def endpoint_url(self) -> str:
        """What clients use as their S3 endpoint."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec options that reach the upstream server through this proxy."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
            "config_kwargs": {"s3": {"addressing_style": "path"}},
        }

    @property
    def environ(self) -> dict[str, str]:
        """The standard AWS variables that reach the upstream server through this proxy."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self) -> FaultProxy:
        """Start serving in a daemon thread."""
        proxy = self

        class Handler(_Handler):
            owner = proxy

        server = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (held requests are released)."""
        with self._lock:
            for held in self._holds:
                held.release()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- decisions (called by the handler) --------------------------------------------
    def _decide(self, operation: str, key: str) -> tuple[str | None, Hold | None]:
        """The fault for one request (None: forward untouched), and a hold if one matches."""
        with self._lock:
            self.requests[operation] += 1
            for held in self._holds:
                if held.operation == operation and fnmatchcase(key, held.key):
                    self._holds.remove(held)
                    held.fault = InjectedFault("hold", operation, key)
                    self.injected.append(held.fault)
                    return None, held
            if self._paused:
                return None, None
            draw = self._random.random()
            for kind, rate in self._table.get(operation, ()):
                if draw < rate:
                    return kind, None
                draw -= rate
        return None, None

    def _record(self, kind: str, operation: str, key: str) -> None:
        with self._lock:
            self.injected.append(InjectedFault(kind, operation, key))

    def _slow(self) -> float:
        with self._lock:
            return self._random.uniform(*self.delay)


@dataclass
class _Reply:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes


class _Handler(BaseHTTPRequestHandler):
    """Reads a request, asks the proxy what to do, forwards it and answers (or not)."""

    owner: FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 does

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: thousands of requests

    def do_GET(self) -> None:
        self._serve()

    def do_PUT(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def do_DELETE(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve()

    def _serve(self) -> None:
        body = self._read_body()
        operation, key = _classify(self.command, self.path, self.headers)
        kind, held = self.owner._decide(operation, key)
        if held is not None:
            self._held(held, body)
            return
        if kind in ("502", "503"):
            self.owner._record(kind, operation, key)
            self._error(kind)
            return
        if kind == "reset":
            self.owner._record(kind, operation, key)
            self._reset()
            return
        if kind == "slow":
            time.sleep(self.owner._slow())
        reply = self._forward(body)
        if kind == "500":
            self.owner._record(kind, operation, key)
            self._error(kind)
        elif kind == "drop":
            self.owner._record(kind, operation, key)
            self._reset()
        elif kind == "truncate" and len(reply.body) > 1:
            self.owner._record(kind, operation, key)
            self._reply(reply, cut=len(reply.body) // 2)
        else:
            if kind == "slow":
                self.owner._record(kind, operation, key)
            self._reply(reply)

    def _held(self, held: Hold, body: bytes) -> None:
        reply = self._forward(body) if held.land else None
        held.arrived.set()
        held.released.wait(300)
        if reply is None:
            self._reset()
            return
        try:
            self._reply(reply)
        except OSError:
            self.close_connection = True  # the client is gone: what the test wanted

    # --- the wire ---------------------------------------------------------------------
    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline().strip():  # trailers
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes) -> _Reply:
        host, port = self.owner.upstream
        # One connection per request: a kept-alive upstream connection that
        # closed under us would need a resend, which could land a write twice.
        conn = http.client.HTTPConnection(host, port, timeout=120)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                    conn.putheader(name, value)
            if body or self.command in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            response = conn.getresponse()
            data = response.read()
            headers = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
            return _Reply(response.status, response.reason, headers, data)
        finally:
            conn.close()

    def _reply(self, reply: _Reply, *, cut: int | None = None) -> None:
        self.send_response_only(reply.status, reply.reason)
        has_length = False
        for name, value in reply.headers:
            if name.lower() == "content-length":
                has_length = True
                if self.command != "HEAD":
                    value = str(len(reply.body))  # noqa: PLW2901
            self.send_header(name, value)
        if not has_length:
            self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        if self.command == "HEAD":
            return
        self.wfile.write(reply.body if cut is None else reply.body[:cut])
        if cut is not None:
            self.wfile.flush()
            self.close_connection = True  # the rest never comes: the client sees EOF

    def _error(self, kind: str) -> None:
        status, code, message = _ERRORS[kind]
        payload = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<RequestId>gradpipe-faultproxy</RequestId></Error>"
        ).encode()
        headers = [("Content-Type", "application/xml")]
        self._reply(_Reply(status, _reason(status), headers, payload))

    def _reset(self) -> None:
        """Close the connection with a TCP RST: the client gets no reply at all."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass


def _reason(status: int) -> str:
    from http import HTTPStatus

    return HTTPStatus(status).phrase


def _classify(method: str, target: str, headers: Any) -> tuple[str, str]:
    """The S3 operation of a request and its ``bucket/key``."""
    parts = urllib.parse.urlsplit(target)
    key = urllib.parse.unquote(parts.path).lstrip("/")
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    if method == "GET":
        operation = "LIST" if "/" not in key.rstrip("/") or "list-type" in query else "GET"
    elif method == "PUT" and "x-amz-copy-source" in headers:
        operation = "COPY"
    elif method == "PUT" and ("If-None-Match" in headers or "If-Match" in headers):
        operation = "CPUT"
    elif method == "POST" and "delete" in query:
        operation = "DELETE"
    else:
        operation = method
    return operation, key
