"""A small HTTP client over the standard library for OpenAI-compatible servers: bounded timeouts, JSON bodies,
server-sent events. Every failure is one ServerError line naming the server."""
from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass
from typing import Iterator, Optional
from urllib.parse import urlsplit

from engine.errors import SpecplayError

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0  # the longest silence tolerated inside a reply (a stalled stream ends in an error)
MAX_BODY_BYTES = 16 << 20
MAX_LINE_BYTES = 4 << 20


class ServerError(SpecplayError):
    """The server could not be reached or answered something unusable."""


@dataclass(frozen=True)
class Address:
    scheme: str
    host: str
    port: int
    base_path: str  # "" or "/prefix" (without a trailing /v1)

    @property
    def label(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.base_path}"


def parse_url(url: str) -> Address:
    """http(s)://host[:port][/prefix][/v1] -> Address; anything else is a ServerError."""
    text = (url or "").strip()
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ServerError(f"server URL {url!r} is not valid ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServerError(f"server URL {url!r} is not an http(s)://host[:port] address")
    path = parts.path.rstrip("/")
    path = path[:-3] if path.endswith("/v1") else path
    return Address(parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), path)


class Connection:
    """One request's connection, with the connect and read timeouts bounded."""

    def __init__(self, address: Address, read_timeout_s: float = READ_TIMEOUT_S):
        cls = http.client.HTTPSConnection if address.scheme == "https" else http.client.HTTPConnection
        self.address = address
        self.read_timeout_s = read_timeout_s
        self.conn = cls(address.host, address.port, timeout=min(CONNECT_TIMEOUT_S, read_timeout_s))

    def send(self, method: str, path: str, body: Optional[dict] = None) -> http.client.HTTPResponse:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json, text/event-stream"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        with _errors(self.address):
            self.conn.connect()
            self.conn.sock.settimeout(self.read_timeout_s)
            self.conn.request(method, self.address.base_path + path, body=data, headers=headers)
            return self.conn.getresponse()

    def close(self) -> None:
        self.conn.close()


class _errors:
    """Turns socket and protocol failures into one ServerError line."""

    def __init__(self, address: Address):
        self.address = address

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, ServerError):
            return False
        where = self.address.label
        if isinstance(exc, (socket.timeout, TimeoutError)):
            raise ServerError(f"{where} did not answer within its timeout (a slow or stalled server)") \
                from None
        if isinstance(exc, ConnectionRefusedError):
            raise ServerError(f"{where} is unreachable: connection refused (is the server running?)") \
                from None
        if isinstance(exc, socket.gaierror):
            raise ServerError(f"{where} is unreachable: unknown host {self.address.host!r}") from None
        cut = (http.client.IncompleteRead, ConnectionResetError, http.client.RemoteDisconnected)
        if isinstance(exc, cut):
            raise ServerError(f"{where} closed the connection mid-reply (cut off)") from None
        if isinstance(exc, (OSError, http.client.HTTPException)):
            raise ServerError(f"{where}: {type(exc).__name__}: {exc}") from None
        return False


def get_text(address: Address, path: str, timeout_s: float = 10.0) -> tuple:
    """(status, body text) of GET path; a refused or silent server raises ServerError."""
    connection = Connection(address, timeout_s)
    try:
        response = connection.send("GET", path)
        with _errors(address):
            body = response.read(MAX_BODY_BYTES + 1)
        if len(body) > MAX_BODY_BYTES:
            raise ServerError(f"{address.label}{path} answered more than {MAX_BODY_BYTES >> 20} MiB")
        return response.status, body.decode("utf-8", "replace")
    finally:
        connection.close()


def get_json(address: Address, path: str, timeout_s: float = 10.0) -> Optional[dict]:
    """The JSON object of GET path, or None when it is not 200 / not a JSON object."""
    status, text = get_text(address, path, timeout_s)
    if status != 200:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def post_json(address: Address, path: str, body: dict, timeout_s: float = READ_TIMEOUT_S) -> dict:
    connection = Connection(address, timeout_s)
    try:
        response = connection.send("POST", path, body)
        with _errors(address):
            text = response.read(MAX_BODY_BYTES + 1).decode("utf-8", "replace")
        _check_status(address, path, response.status, text)
        return _json_object(address, path, text)
    finally:
        connection.close()


def post_events(address: Address, path: str, body: dict,
                timeout_s: float = READ_TIMEOUT_S) -> Iterator[tuple]:
    """POST path and yield (arrival time in perf_counter seconds, JSON object) for each server-sent event's
    `data:` line until `data: [DONE]` or the end of the stream. A stream that ends without [DONE] is a
    ServerError (cut off); a reply that is not an event stream of JSON objects too."""
    connection = Connection(address, timeout_s)
    try:
        response = connection.send("POST", path, body)
        if response.status != 200:
            with _errors(address):
                text = response.read(64 << 10).decode("utf-8", "replace")
            _check_status(address, path, response.status, text)
        yield from _events(address, path, response)
    finally:
        connection.close()


def _events(address: Address, path: str, response) -> Iterator[tuple]:
    kind = response.getheader("Content-Type", "") or ""
    if "text/event-stream" not in kind:
        with _errors(address):
            head = response.read(200).decode("utf-8", "replace")
        raise ServerError(f"{address.label}{path} did not answer an event stream (Content-Type {kind!r}: "
                          f"{head[:80]!r}): not an OpenAI-compatible server?")
    while True:
        with _errors(address):
            line = response.readline(MAX_LINE_BYTES)
        if not line:
            raise ServerError(f"{address.label}{path}: the stream was cut off before its end ([DONE])")
        line = line.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, event: / id: fields
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield time.perf_counter(), _json_object(address, path, data.decode("utf-8", "replace"))


def _check_status(address: Address, path: str, status: int, text: str) -> None:
    if status == 200:
        return
    detail = text.strip().replace("\n", " ")[:160]
    try:
        error = json.loads(text).get("error")
        detail = (error.get("message") if isinstance(error, dict) else str(error)) or detail
    except (ValueError, AttributeError):
        pass
    raise ServerError(f"{address.label}{path} answered HTTP {status}: {detail}")


def _json_object(address: Address, path: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ServerError(f"{address.label}{path} answered something that is not a JSON object: "
                          f"{text[:80]!r} "
                          "(not an OpenAI-compatible server?)")
    if "error" in value and "choices" not in value:
        error = value["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise ServerError(f"{address.label}{path} reported an error: {message}")
    return value
