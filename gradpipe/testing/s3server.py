"""A real S3 server on loopback for tests and benchmarks (moto's server).

moto answers conditional writes (``If-None-Match``, ``If-Match``) by checking
and then writing in two steps, which real S3 does atomically. The server
here runs moto's WSGI app behind one lock for writes so that, under
concurrent clients, it behaves like S3 rather than like a race: without it a
concurrency test would measure moto, not gradpipe.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["S3Server"]

_WRITES = {"PUT", "POST", "DELETE"}


class S3Server:
    """moto's S3 on ``http://127.0.0.1:<port>``; use as a context manager.

    >>> with S3Server() as server:  # doctest: +SKIP
    ...     server.make_bucket("test")
    ...     server.storage_options
    """

    def __init__(self, port: int = 0) -> None:
        self.port = port or _free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._server: Any = None
        self._thread: threading.Thread | None = None

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
        """Start serving in a daemon thread."""
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import WSGIRequestHandler, make_server

        class QuietHandler(WSGIRequestHandler):
            def log_request(self, *args: object) -> None:
                pass

        app = _serialize_writes(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(
            "127.0.0.1", self.port, app, threaded=True, request_handler=QuietHandler
        )
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def reset(self) -> None:
        """Forget every bucket and object (moto's reset API)."""
        self._call("POST", "/moto-api/reset")

    def make_bucket(self, name: str) -> None:
        """Create a bucket."""
        self._call("PUT", f"/{name}")

    def _call(self, method: str, path: str) -> None:
        import urllib.request

        url = f"{self.endpoint_url}{path}"  # always our own http://127.0.0.1 server
        request = urllib.request.Request(url, method=method)  # noqa: S310
        with urllib.request.urlopen(request, timeout=10):  # noqa: S310
            pass

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
