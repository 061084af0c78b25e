"""JSON over HTTP to a local server with the standard library: requests, answers, server-sent events.

Proxies are never used (the servers are on 127.0.0.1, and a proxy set in the environment must not
see the requests). An HTTP error raises InternalError with the server's own message.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from quantkit.errors import InternalError

REQUEST_TIMEOUT_S = 600.0
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def request(url: str, body: dict | None = None) -> urllib.request.Request:
    data = None if body is None else json.dumps(body).encode()
    return urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})


def is_healthy(url: str, timeout: float = 2.0) -> bool:
    """True when GET url answers 200 (False when nothing listens yet or it answers otherwise)."""
    try:
        with OPENER.open(request(url), timeout=timeout) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def error_message(exc: urllib.error.HTTPError) -> str:
    """The server's reason for an HTTP error: its JSON `error` (or `message`), else the body."""
    text = exc.read().decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:300] or exc.reason
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        error = error.get("message", error)
    return str(error)[:300]


def get_json(url: str, timeout: float = 30.0) -> dict:
    try:
        with OPENER.open(request(url), timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        raise InternalError(f"GET {url}: HTTP {exc.code}: {error_message(exc)}") from None


def post_json(url: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
    """POST a JSON body and return the JSON answer."""
    try:
        with OPENER.open(request(url, body), timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        raise InternalError(f"POST {url}: HTTP {exc.code}: {error_message(exc)}") from None


def sse_events(lines) -> Iterator[dict]:
    """The JSON payloads of server-sent `data:` lines, up to `data: [DONE]` (comments and blanks skipped)."""
    for raw in lines:
        line = raw.decode("utf-8", "replace").strip() if isinstance(raw, bytes) else raw.strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def post_stream(url: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> Iterator[tuple[float, dict]]:
    """POST a streaming request; yield (time.perf_counter() at arrival, event) per server-sent event."""
    try:
        with OPENER.open(request(url, body), timeout=timeout) as response:
            for event in sse_events(response):
                yield time.perf_counter(), event
    except urllib.error.HTTPError as exc:
        raise InternalError(f"POST {url}: HTTP {exc.code}: {error_message(exc)}") from None
