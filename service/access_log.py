"""Request ids (``X-Request-Id``) and the access log: one ``key=value`` line per finished request.

The line goes to logger ``mindserve.access`` (the app's ``log_function``), e.g.
``request_id=4f1c… method=POST path=/generate status=200 prompt_tokens=7 generated_tokens=20 latency_ms=812.4``.
"""
from __future__ import annotations

import logging
import re
import uuid
from typing import Any

import tornado.httputil
import tornado.web

REQUEST_ID_HEADER = "X-Request-Id"
CLIENT_GONE = 499  # the status logged for a request whose client left before its response ended (nginx's)
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_BARE_VALUE = re.compile(r"[^\s\"=]+")

log = logging.getLogger("mindserve.access")


def request_id_for(request: tornado.httputil.HTTPServerRequest) -> str:
    """The client's ``X-Request-Id`` when it is 1..64 of ``[A-Za-z0-9._-]``, else a new random id."""
    sent = request.headers.get(REQUEST_ID_HEADER, "")
    return sent if _CLIENT_REQUEST_ID.fullmatch(sent) else uuid.uuid4().hex


def log_request(handler: tornado.web.RequestHandler) -> None:
    """``Application(log_function=...)``: Tornado calls it once for every finished request (and the
    handlers for a request whose client left while its body was read). A client gone before the response
    ended is logged as ``CLIENT_GONE``, with the tokens generated until then."""
    status = CLIENT_GONE if getattr(handler, "client_gone", False) else handler.get_status()
    observer = getattr(handler, "observer", None)
    fields = {
        "request_id": getattr(handler, "request_id", None),
        "method": handler.request.method,
        "path": handler.request.path,
        "status": status,
        "prompt_tokens": getattr(observer, "prompt_tokens", None),
        "generated_tokens": getattr(observer, "tokens_generated", None),
        "latency_ms": f"{1000.0 * handler.request.request_time():.1f}",
        "client": handler.request.remote_ip,
    }
    # 503 is a state the server announces (still warming up, or draining), not a fault: probes poll it
    log.log(logging.ERROR if status >= 500 and status != 503 else logging.INFO, format_fields(fields))


def format_fields(fields: dict[str, Any]) -> str:
    """``k=v`` pairs; None is ``-``; values with spaces, quotes or ``=`` are double-quoted."""
    return " ".join(f"{key}={_value(value)}" for key, value in fields.items())


def _value(value: Any) -> str:
    if value is None:
        return "-"
    text = str(value)
    if _BARE_VALUE.fullmatch(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
