"""S3 backend over s3fs: conditional writes, batched concurrent requests.

Creates use ``If-None-Match: *`` and ref swaps ``If-Match: <etag>`` (S3 has
supported both since 2024; so do MinIO and moto), so neither needs a lock.
Batched calls run on s3fs's event loop with a bounded number of requests in
flight. Requests are retried by the S3 client (botocore's retry configuration,
see :mod:`gradpipe.storage.retries`), and a GET together with the read of its
body by s3fs's retries, as s3fs reads files: botocore hands back a body
before reading it, so a reply cut short would otherwise never be retried.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

from fsspec.asyn import sync

from gradpipe.config import get_setting
from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.errors import ConflictError, InvalidInputError, NotFoundError, StorageError
from gradpipe.storage.backend import Backend, KeyInfo, VersionedBytes
from gradpipe.storage.retries import with_retries

__all__ = ["S3Backend", "from_url"]

T = TypeVar("T")
R = TypeVar("R")


def from_url(url: str, path: str, storage_options: dict[str, Any]) -> S3Backend:
    """The backend of an ``s3://bucket/prefix`` URL."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url, **with_retries(storage_options))
    except ImportError:
        raise InvalidInputError(
            f"{printable(url, limit=PATH_LIMIT)}: S3 stores need s3fs; install it with `pip "
            "install 'gradpipe[s3]'`"
        ) from None
    if not root.strip("/"):
        raise InvalidInputError(
            f"{printable(url, limit=PATH_LIMIT)}: name a bucket, as in s3://bucket/prefix"
        )
    return S3Backend(fs, root)


def _is_transport_error(exc: BaseException) -> bool:
    """An error of the connection or the client, not an S3 answer: retries ran out."""
    from aiohttp import ClientError
    from botocore.exceptions import BotoCoreError  # type: ignore[import-untyped]

    return isinstance(exc, OSError | asyncio.TimeoutError | BotoCoreError | ClientError)


def _error_code(exc: BaseException) -> str:
    """The S3 error code behind an exception s3fs may have translated."""
    for err in (exc, exc.__cause__, exc.__context__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code", ""))
    return ""


class S3Backend(Backend):
    """A store rooted at ``s3://bucket/prefix``."""

    # A HEAD before each create would double the requests of new blocks; the
    # create's 412 answers "exists" (and only then is the block's age looked up).
    write_first = True

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root.strip("/")
        self.bucket, _, self.prefix = self.root.partition("/")
        self.url = f"s3://{self.root}"
        self._limit = int(get_setting("storage.concurrency"))

    # --- plumbing -------------------------------------------------------------
    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _run(self, coro: Awaitable[T]) -> T:
        return sync(self.fs.loop, lambda: coro)  # type: ignore[no-any-return]

    def _gather(self, fn: Callable[[T], Awaitable[R]], items: Sequence[T]) -> list[R | Exception]:
        async def bounded() -> list[R | Exception]:
            gate = asyncio.Semaphore(self._limit)

            async def one(item: T) -> R:
                async with gate:
                    return await fn(item)

            return await asyncio.gather(*(one(i) for i in items), return_exceptions=True)  # type: ignore[return-value]

        return self._run(bounded()) if items else []

    def _translate(self, exc: BaseException, key: str, doing: str) -> Exception:
        if _error_code(exc) == "NoSuchBucket":
            return StorageError(
                f"bucket {printable(self.bucket)} does not exist (store "
                f"{printable(self.url, limit=PATH_LIMIT)}); "
                "create it first"
            )
        if isinstance(exc, FileNotFoundError) or _error_code(exc) in ("NoSuchKey", "404"):
            return NotFoundError(
                f"{printable(key, limit=PATH_LIMIT)} not found in store "
                f"{printable(self.url, limit=PATH_LIMIT)}"
            )
        if _is_transport_error(exc) or _error_code(exc):
            return StorageError(
                f"could not {doing} {printable(key, limit=PATH_LIMIT)} in store "
                f"{printable(self.url, limit=PATH_LIMIT)}: {exc}"
            )
        return exc if isinstance(exc, Exception) else StorageError(str(exc))

    async def _call(self, method: str, **kwargs: Any) -> dict[str, Any]:
        return await self.fs._call_s3(method, Bucket=self.bucket, **kwargs)  # type: ignore[no-any-return]

    async def _get(self, key: str) -> tuple[bytes, str]:
        """An object's bytes and ETag; the GET is retried with the read of its body."""
        # s3fs's own wrapper, as its cat_file uses it: a body cut short (Content-Length
        # not met) is retried as a whole GET, with the filesystem's ``retries``.
        from s3fs.core import _error_wrapper  # type: ignore[import-untyped]

        async def get_and_read() -> tuple[bytes, str]:
            response = await self._call("get_object", Key=self._key(key))
            async with response["Body"] as body:
                return await body.read(), str(response["ETag"])

        return await _error_wrapper(get_and_read, retries=self.fs.retries)  # type: ignore[no-any-return]

    # --- immutable objects ----------------------------------------------------
    async def _read(self, key: str) -> bytes:
        try:
            data, _etag = await self._get(key)
        except Exception as exc:
            raise self._translate(exc, key, "read") from exc
        return data

    def read(self, key: str) -> bytes:
        return self._run(self._read(key))

    def read_many(self, keys: Sequence[str]) -> list[bytes | Exception]:
        return self._gather(self._read, keys)

    async def _create(self, item: tuple[str, bytes | memoryview]) -> bool:
        key, data = item
        for _attempt in range(5):
            try:
                await self._call(
                    "put_object", Key=self._key(key), Body=bytes(data), IfNoneMatch="*"
                )
            except FileExistsError:
                return False  # includes a retry whose first attempt landed
            except Exception as exc:
                code = _error_code(exc)
                if code == "PreconditionFailed":
                    return False
                if code == "ConditionalRequestConflict":
                    await asyncio.sleep(0.05)  # a concurrent create of the same key
                    continue
                raise self._translate(exc, key, "write") from exc
            else:
                return True
        # Still conflicting: report "exists" only if it does, never on faith.
        if await self._mtime(key) is not None:
            return False
        raise StorageError(
            f"could not write {printable(key, limit=PATH_LIMIT)} in store "
            f"{printable(self.url, limit=PATH_LIMIT)}: "
            "concurrent writes "
            "kept conflicting"
        )

    def write_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        return self._run(self._create((key, data)))

    def write_many_if_absent(self, items: Sequence[tuple[str, bytes | memoryview]]) -> list[bool]:
        results = self._gather(self._create, items)
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results  # type: ignore[return-value]

    async def _mtime(self, key: str) -> float | None:
        try:
            response = await self._call("head_object", Key=self._key(key))
        except Exception as exc:
            translated = self._translate(exc, key, "stat")
            if isinstance(translated, NotFoundError):
                return None
            raise translated from exc
        return float(response["LastModified"].timestamp())

    def mtimes(self, keys: Sequence[str]) -> list[float | None]:
        results = self._gather(self._mtime, keys)
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results  # type: ignore[return-value]

    def touch(self, key: str) -> None:
        # A server-side copy onto itself: new LastModified, no data transfer.
        source = {"Bucket": self.bucket, "Key": self._key(key)}
        try:
            self._run(
                self._call(
                    "copy_object",
                    Key=self._key(key),
                    CopySource=source,
                    MetadataDirective="REPLACE",
                )
            )
        except Exception as exc:
            raise self._translate(exc, key, "touch") from exc

    def delete(self, key: str) -> None:
        try:
            self._run(self._call("delete_object", Key=self._key(key)))
        except Exception as exc:
            translated = self._translate(exc, key, "delete")
            if not isinstance(translated, NotFoundError):
                raise translated from exc

    def delete_many(self, keys: Sequence[str]) -> None:
        async def bulk(batch: Sequence[str]) -> None:
            objects = [{"Key": self._key(k)} for k in batch]
            response = await self._call("delete_objects", Delete={"Objects": objects})
            errors = [e for e in response.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise StorageError(
                    f"could not delete {len(errors)} key(s) in store "
                    f"{printable(self.url, limit=PATH_LIMIT)}, e.g. "
                    f"{printable(first.get('Key'), limit=PATH_LIMIT)}: "
                    f"{first.get('Code')} {first.get('Message', '')}"
                )

        batches = [keys[i : i + 1000] for i in range(0, len(keys), 1000)]
        for result in self._gather(bulk, batches):
            if isinstance(result, Exception):
                raise self._translate(result, "", "delete") from result

    def list(self, prefix: str) -> Iterator[KeyInfo]:
        top = f"{self.root}/{prefix}"
        try:
            found = self.fs.find(top, detail=True)
        except Exception as exc:
            raise self._translate(exc, prefix, "list") from exc
        strip = len(self.root) + 1
        under = f"{prefix}/" if prefix else ""
        for path, info in sorted(found.items()):
            if info.get("type") == "directory":
                # s3fs answers an empty prefix it listed before from its cache,
                # as a directory; our deletes bypass that cache.
                continue
            key = path[strip:]
            if not key.startswith(under):
                continue  # s3fs finds the object named like the prefix, which is not under it
            modified = info.get("LastModified")
            mtime = float(modified.timestamp()) if modified is not None else 0.0
            yield KeyInfo(key, int(info.get("size", 0)), mtime)

    # --- refs -----------------------------------------------------------------
    def read_versioned(self, key: str) -> VersionedBytes | None:
        try:
            return VersionedBytes(*self._run(self._get(key)))
        except Exception as exc:
            translated = self._translate(exc, key, "read")
            if isinstance(translated, NotFoundError):
                return None
            raise translated from exc

    def swap(self, key: str, data: bytes, expected: str | None) -> str:
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        try:
            response = self._run(
                self._call("put_object", Key=self._key(key), Body=data, **condition)
            )
        except Exception as exc:
            code = _error_code(exc)
            if isinstance(exc, FileExistsError) or code in (
                "PreconditionFailed",
                "ConditionalRequestConflict",
                "NoSuchKey",
            ):
                raise ConflictError(
                    f"ref {printable(key, limit=PATH_LIMIT)} in store "
                    f"{printable(self.url, limit=PATH_LIMIT)} was "
                    "moved by another writer"
                ) from None
            raise self._translate(exc, key, "update") from exc
        return str(response["ETag"])

    def delete_all(self) -> None:
        try:
            paths = self.fs.find(self.root)
            marker = f"{self.root}/gradpipe.json"
            # The marker goes last: a crash half-way leaves a store, not a stray prefix.
            rest = [p for p in paths if p != marker]
            if rest:
                self.fs.rm(rest)
            if marker in paths:
                self.fs.rm(marker)
        except Exception as exc:
            raise self._translate(exc, "", "delete") from exc
        self.fs.invalidate_cache()
