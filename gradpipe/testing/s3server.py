"""A real S3 server on loopback for tests and benchmarks (moto's server).

moto answers conditional writes (``If-None-Match``, ``If-Match``) by checking
and then writing in two steps, which real S3 does atomically. The server
here runs moto's WSGI app behind one lock for writes so that, under
concurrent clients, it behaves like S3 rather than like a race: without it a
concurrency test would measure moto, not gradpipe.

With ``S3Server(fault_layer=True)`` a WSGI middleware sits in front of moto
and can lose replies: a request matching a :class:`LostReply` rule reaches
moto and does its work, and the client gets a 5xx instead of moto's answer,
so botocore retries it, exactly as when a real reply is lost on the way. A
retried ``If-None-Match: *`` or ``If-Match`` PUT then gets a 412 although
the write it retries landed. Without ``fault_layer`` nothing is in front of
moto at all.

``with server.count_requests() as counts:`` counts the requests the server
answers inside the block, by S3 operation (HEAD, GET, PUT, LIST, DELETE,
COPY, POST), with the bytes of request bodies PUT: what a benchmark reports
as requests per dump. Counting is off outside such a block.

``S3Server(process=True)`` serves from a child process, so that moto's
request handling does not share the client's interpreter (and its GIL):
what a benchmark wants. Counting and ``reset`` work through the HTTP port;
``lose_replies`` and ``set_mtime`` need the server in this process.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from http import HTTPStatus
from typing import Any

__all__ = ["LostReply", "RequestCounts", "S3Request", "S3Server"]

_WRITES = {"PUT", "POST", "DELETE"}
#: Where the counting layer takes its orders (no bucket name starts with ``_``).
_CONTROL = "/_gradpipe/requests"
#: The S3 operations requests are counted as.
OPERATIONS = ("HEAD", "GET", "PUT", "COPY", "LIST", "DELETE", "POST")


@dataclass
class RequestCounts:
    """Requests a server answered, by S3 operation, and the bytes of their bodies."""

    by_operation: Counter[str] = field(default_factory=Counter)
    bytes_put: int = 0  # request bodies of PUT and POST (uploads)
    bytes_got: int = 0  # response bodies of GET

    @property
    def total(self) -> int:
        """Every request counted."""
        return sum(self.by_operation.values())

    def __getitem__(self, operation: str) -> int:
        return self.by_operation[operation]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what the counting layer sends over HTTP)."""
        return {
            "by_operation": dict(self.by_operation),
            "bytes_put": self.bytes_put,
            "bytes_got": self.bytes_got,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RequestCounts:
        """Inverse of :meth:`to_dict`."""
        return cls(Counter(doc["by_operation"]), int(doc["bytes_put"]), int(doc["bytes_got"]))


class S3Server:
    """moto's S3 on ``http://127.0.0.1:<port>``; use as a context manager.

    >>> with S3Server() as server:  # doctest: +SKIP
    ...     server.make_bucket("test")
    ...     server.storage_options
    """

    def __init__(self, port: int = 0, *, fault_layer: bool = False, process: bool = False) -> None:
        if fault_layer and process:
            raise ValueError("the fault layer needs the server in this process (process=False)")
        self.port = port or _free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._process: Any = None
        self._faults: _FaultLayer | None = None
        self._fault_layer = fault_layer
        self._in_process = not process

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec options that reach this server."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
        }

    @property
    def environ(self) -> dict[str, str]:
        """The standard AWS variables that reach this server."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self) -> S3Server:
        """Start serving: in a daemon thread, or in a child process (``process=True``)."""
        if not self._in_process:
            # spawn, not fork: the parent may run threads (s3fs's event loop, Dask's).
            context = multiprocessing.get_context("spawn")
            self._process = context.Process(target=_serve, args=(self.port,), daemon=True)
            self._process.start()
            _wait_for_port(self.port, self._process)
            return self
        self._server, self._faults = _make_server(self.port, fault_layer=self._fault_layer)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._process is not None:
            self._process.terminate()
            self._process.join(10)
            self._process = None

    @contextmanager
    def count_requests(self) -> Iterator[RequestCounts]:
        """Count the requests answered inside the ``with`` block; the counts fill in at its end.

        One count at a time per server; requests of every client are counted.
        """
        counts = RequestCounts()
        self._call("POST", f"{_CONTROL}/start")
        try:
            yield counts
        finally:
            done = RequestCounts.from_dict(json.loads(self._call("POST", f"{_CONTROL}/stop")))
            counts.by_operation, counts.bytes_put = done.by_operation, done.bytes_put
            counts.bytes_got = done.bytes_got

    @contextmanager
    def lose_replies(self, *rules: LostReply) -> Iterator[list[S3Request]]:
        """Apply ``rules`` inside the ``with`` block; yields the log of requests meanwhile.

        Needs ``S3Server(fault_layer=True)``. The log lists every request the
        server received in the block, with moto's status and the one sent back.
        """
        if self._faults is None:
            raise RuntimeError(
                "start the server with S3Server(fault_layer=True) (and process=False) "
                "to lose replies"
            )
        faults = self._faults
        log: list[S3Request] = []
        with faults.lock:
            faults.rules = [*faults.rules, *rules]
            faults.logs.append(log)
        try:
            yield log
        finally:
            with faults.lock:
                faults.rules = [r for r in faults.rules if all(r is not x for x in rules)]
                faults.logs.remove(log)

    def reset(self) -> None:
        """Forget every bucket and object (moto's reset API)."""
        self._call("POST", "/moto-api/reset")

    def set_mtime(self, bucket: str, key: str, mtime: float) -> None:
        """Set an object's last-modified time (moto runs in this process), for tests."""
        from datetime import UTC, datetime

        from moto.s3.models import s3_backends

        if not self._in_process:
            raise RuntimeError("set_mtime needs the server in this process (process=False)")
        account = "123456789012"  # moto's default account, which our credentials map to
        obj = s3_backends[account]["global"].buckets[bucket].keys[key]
        # moto keeps naive UTC times.
        obj.last_modified = datetime.fromtimestamp(mtime, UTC).replace(tzinfo=None)

    def make_bucket(self, name: str) -> None:
        """Create a bucket."""
        self._call("PUT", f"/{name}")

    def _call(self, method: str, path: str) -> bytes:
        import urllib.request

        url = f"{self.endpoint_url}{path}"  # always our own http://127.0.0.1 server
        request = urllib.request.Request(url, method=method)  # noqa: S310
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            return response.read()  # type: ignore[no-any-return]

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class LostReply:
    """A rule of the fault layer: which requests lose their reply.

    Parameters
    ----------
    method : str
        HTTP method (``"PUT"``, ``"DELETE"``, ...).
    key : str
        :func:`fnmatch.fnmatchcase` pattern on ``bucket/key`` (``*`` crosses ``/``).
    calls : container of int, optional
        Which matching requests lose their reply, counting from 1; all if None.
    header : str, optional
        Only requests carrying this header (``"If-Match"``, ``"If-None-Match"``).
    status : int
        The status sent instead of moto's (500 and 503 are retried by botocore).
    code : str, optional
        The S3 error code in the body (default: by status, ``ServiceUnavailable``
        or ``InternalError``); e.g. ``ConditionalRequestConflict`` with 409.
    reach : bool
        Let the request reach moto first (True: the reply is lost; False: the
        request is).
    """

    method: str
    key: str = "*"
    calls: Container[int] | None = None
    header: str | None = None
    status: int = 503
    code: str | None = None
    reach: bool = True
    matched: int = field(default=0, init=False)
    fired: int = field(default=0, init=False)

    def matches(self, method: str, path: str, environ: dict[str, Any]) -> bool:
        """Whether this rule is about the request at all (calls aside)."""
        if method != self.method or not fnmatchcase(path, self.key):
            return False
        return self.header is None or _header_key(self.header) in environ


@dataclass(frozen=True)
class S3Request:
    """One request the fault layer saw: what moto answered and what the client got."""

    method: str
    path: str  # bucket/key
    headers: frozenset[str]  # the conditional headers it carried
    moto_status: int | None  # None: it never reached moto
    status: int


_CONDITIONS = ("If-Match", "If-None-Match")


def _header_key(name: str) -> str:
    return "HTTP_" + name.upper().replace("-", "_")


class _FaultLayer:
    """WSGI middleware in front of moto that replaces replies by errors, by rule."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.rules: list[LostReply] = []
        self.logs: list[list[S3Request]] = []
        self.lock = threading.Lock()

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        if not self.logs:  # nothing asked for: moto answers, untouched
            return self.app(environ, start_response)
        method = str(environ.get("REQUEST_METHOD", ""))
        path = str(environ.get("PATH_INFO", "")).lstrip("/")
        rule = self._due(method, path, environ)
        statuses: list[int] = []

        def keep_status(status: str, headers: Any, exc_info: Any = None) -> Callable[..., Any]:
            statuses.append(int(status.split(maxsplit=1)[0]))
            if rule is None:
                return start_response(status, headers, exc_info)  # type: ignore[no-any-return]
            return lambda _data: None

        body: Iterable[bytes] = []
        if rule is None or rule.reach:
            body = list(self.app(environ, keep_status))
        else:
            _drain(environ)
        moto_status = statuses[0] if statuses else None
        status = moto_status if rule is None else rule.status
        self._record(S3Request(method, path, _conditions(environ), moto_status, status or 0))
        if rule is None:
            return body
        code = rule.code or ("ServiceUnavailable" if rule.status == 503 else "InternalError")
        payload = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            f"<Error><Code>{code}</Code><Message>injected: reply lost</Message></Error>"
        ).encode()
        start_response(
            f"{rule.status} {HTTPStatus(rule.status).phrase}",
            [("Content-Type", "application/xml"), ("Content-Length", str(len(payload)))],
        )
        return [payload]

    def _due(self, method: str, path: str, environ: dict[str, Any]) -> LostReply | None:
        due = None
        with self.lock:
            for rule in self.rules:
                if not rule.matches(method, path, environ):
                    continue
                rule.matched += 1
                if due is None and (rule.calls is None or rule.matched in rule.calls):
                    rule.fired += 1
                    due = rule
        return due

    def _record(self, request: S3Request) -> None:
        with self.lock:
            for log in self.logs:
                log.append(request)


def _conditions(environ: dict[str, Any]) -> frozenset[str]:
    return frozenset(h for h in _CONDITIONS if _header_key(h) in environ)


def _drain(environ: dict[str, Any]) -> None:
    """Read a request body nobody will use, so the connection stays in step."""
    from werkzeug.wrappers import Request

    Request(environ).get_data()


def _operation(environ: dict[str, Any]) -> str:
    """The S3 operation of a request, from its method, path and query."""
    method = str(environ.get("REQUEST_METHOD", ""))
    path = str(environ.get("PATH_INFO", "")).strip("/")
    query = urllib.parse.parse_qs(str(environ.get("QUERY_STRING", "")), keep_blank_values=True)
    if method == "GET":
        return "LIST" if "/" not in path or "list-type" in query else "GET"
    if method == "PUT" and "HTTP_X_AMZ_COPY_SOURCE" in environ:
        return "COPY"
    if method == "POST" and "delete" in query:
        return "DELETE"  # DeleteObjects: many keys, one request
    return method


class _CountingLayer:
    """WSGI middleware that counts requests by operation, while asked to."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.counts: RequestCounts | None = None
        self.lock = threading.Lock()

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        if str(environ.get("PATH_INFO", "")).startswith(_CONTROL):
            return self._control(environ, start_response)
        counts = self.counts
        if counts is None:
            return self.app(environ, start_response)
        operation = _operation(environ)
        uploaded = int(environ.get("CONTENT_LENGTH") or 0) if operation in ("PUT", "POST") else 0
        body = list(self.app(environ, start_response))
        with self.lock:
            counts.by_operation[operation] += 1
            counts.bytes_put += uploaded
            if operation == "GET":
                counts.bytes_got += sum(len(b) for b in body)
        return body

    def _control(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        with self.lock:
            if str(environ["PATH_INFO"]).endswith("/start"):
                self.counts = RequestCounts()
                payload = b"{}"
            else:
                payload = json.dumps((self.counts or RequestCounts()).to_dict()).encode()
                self.counts = None
        start_response(
            "200 OK",
            [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))],
        )
        return [payload]


def _make_server(port: int, *, fault_layer: bool) -> tuple[Any, _FaultLayer | None]:
    """moto's app behind the write lock, the optional fault layer and the counting layer."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import WSGIRequestHandler, make_server

    class QuietHandler(WSGIRequestHandler):
        def log_request(self, *args: object) -> None:
            pass

    app = _serialize_writes(DomainDispatcherApplication(create_backend_app))
    faults = None
    if fault_layer:
        app = faults = _FaultLayer(app)
    server = make_server(
        "127.0.0.1", port, _CountingLayer(app), threaded=True, request_handler=QuietHandler
    )
    return server, faults


def _serve(port: int) -> None:
    """The body of a server's child process."""
    server, _ = _make_server(port, fault_layer=False)
    server.serve_forever()


def _wait_for_port(port: int, process: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.is_alive():
            raise RuntimeError(f"the S3 server process exited with code {process.exitcode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the S3 server process did not listen on port {port} in {timeout:.0f} s")


def _serialize_writes(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    lock = threading.Lock()

    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in _WRITES:
            return app(environ, start_response)
        with lock:
            return list(app(environ, start_response))

    return wsgi


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
