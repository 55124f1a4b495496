"""How S3 requests are retried: botocore's retry configuration, filled in from gradpipe's settings.

Transient failures (5xx replies, ``SlowDown``, connection resets, replies cut
short) are retried by the S3 client itself, never by loops of gradpipe's own:
botocore's *standard* retry mode (exponential backoff with jitter, a retry
quota; ``adaptive`` adds client-side rate limiting when throttled) up to
``gradpipe.storage.retries.max-attempts`` attempts in all, and around it
s3fs's own retries (``retries=``, 5 by default) of connection errors and
``SlowDown`` replies that outlast botocore's. A retried write is safe because
every gradpipe write is conditional: a create whose first attempt landed gets
a 412 ("exists", which is success), and a ref swap whose first attempt landed
is recognised by its write id (:mod:`gradpipe.storage.refs`).

What decides, most specific first: ``storage_options={"config_kwargs":
{"retries": {...}}}``; the standard AWS variables ``AWS_RETRY_MODE`` and
``AWS_MAX_ATTEMPTS``; the settings ``gradpipe.storage.retries.mode`` and
``gradpipe.storage.retries.max-attempts``.
"""

from __future__ import annotations

import os
from typing import Any, Final

from gradpipe.config import get_setting
from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = ["MODES", "with_retries"]

#: botocore's retry modes.
MODES: Final = ("standard", "adaptive", "legacy")


def with_retries(storage_options: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` for s3fs with the retry configuration filled in where not given.

    Returns a new dict; ``storage_options`` is not changed.

    >>> with_retries({})["config_kwargs"]["retries"]  # doctest: +SKIP
    {'mode': 'standard', 'total_max_attempts': 5}
    """
    config = dict(storage_options.get("config_kwargs") or {})
    retries = dict(config.get("retries") or {})
    if "mode" not in retries and not os.environ.get("AWS_RETRY_MODE"):
        mode = str(get_setting("storage.retries.mode"))
        if mode not in MODES:
            raise InvalidInputError(
                f"gradpipe.storage.retries.mode must be one of {', '.join(MODES)}, not "
                f"{printable(mode)}"
            )
        retries["mode"] = mode
    given = "max_attempts" in retries or "total_max_attempts" in retries
    if not given and not os.environ.get("AWS_MAX_ATTEMPTS"):
        attempts = get_setting("storage.retries.max-attempts")
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise InvalidInputError(
                "gradpipe.storage.retries.max-attempts must be an integer >= 1 "
                f"(attempts in all, the first included), not {printable(attempts)}"
            )
        # botocore's client option ``max_attempts`` counts retries; ``total_max_attempts``
        # counts attempts, as AWS_MAX_ATTEMPTS and the setting do.
        retries["total_max_attempts"] = attempts
    if retries:
        config["retries"] = retries
    return {**storage_options, "config_kwargs": config} if config else dict(storage_options)
