"""Bounds on what one client can send before its body reaches an endpoint: who may call the API at all (its
key, 401), the body's size (413), its coding (415), its JSON nesting (400) and how long it takes to come (408),
checked by ASGI wrappers; the body's is read once and handed on. The other bounds (the waiting queue, a request's
share of the active slots, stop strings, connections, the time a request's head takes, the time a response waits
on its client) are applied where their objects live: the scheduler, the schemas, the connections the protocol
counts (`http_protocol`, ConnectionLimit) and its deadlines."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import struct
from dataclasses import dataclass

try:  # the kernel's count of a socket's unacknowledged bytes (Linux)
    import fcntl
    import termios
    OUTQ = termios.TIOCOUTQ
except (ImportError, AttributeError):
    OUTQ = None


@dataclass(frozen=True)
class ServerLimits:
    """The server's bounds; defaults near what llama-server and vLLM users meet (`serve`'s flags change them)."""
    max_body_bytes: int = 8 * 2**20  # a request body; larger: 413
    max_json_depth: int = 32  # nested arrays and objects in a body; deeper: 400 (json.loads recurses)
    max_waiting: int = 256  # requests waiting for admission; more: 429 with Retry-After
    max_connections: int = 512  # open connections; more: 503 with Retry-After (ConnectionLimit)
    retry_after_s: int = 1  # what a 429 asks the client to wait
    responses_kept: int = 256  # /v1/responses answers kept for previous_response_id (responses.KeptResponses)
    allowed_origins: tuple[str, ...] = ("*",)  # web pages that may call the API from a browser (CORS), as vLLM's
    api_key: str | None = None  # when set, requests must send "Authorization: Bearer KEY" (as vLLM's --api-key)
    read_timeout_s: float = 30.0  # a request's head must arrive this soon after its connection opens (or its last
    # response ends), else the connection is closed; its body this soon after its head, else 408; and a client
    # that a response waits on (its socket full) must take some of its bytes this often, else the connection is cut


def json_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in a JSON text (0 for a scalar); brackets within strings are skipped.
    In a few linear passes of array operations: a quote opens or closes a string unless an odd run of backslashes
    precedes it, as in json's own scanner (a backtracking pattern took seconds on a body of escaped quotes, with
    the event loop held). On a text that is not JSON it can count too deep, never too shallow: json.loads stops
    at the first character out of place."""
    import numpy as np  # here: `serve --help` reads this module's defaults without numpy
    b = np.frombuffer(body, np.uint8)
    step = np.zeros(256, np.int8)
    step[[ord("["), ord("{")]], step[[ord("]"), ord("}")]] = 1, -1
    step = step[b]
    quotes = np.flatnonzero(b == ord('"'))
    if quotes.size:
        if (b == ord("\\")).any():
            at = np.arange(b.size, dtype=np.int32)
            other = np.maximum.accumulate(np.where(b == ord("\\"), -1, at))  # the last non-backslash up to each
            before = quotes - 1
            escapes = np.where(before >= 0, before - other[np.maximum(before, 0)], 0)
            quotes = quotes[escapes % 2 == 0]
        toggles = np.zeros(b.size, np.int8)
        toggles[quotes] = 1
        step[np.cumsum(toggles, dtype=np.int32) % 2 == 1] = 0  # within a string (its opening quote on)
    return int(np.cumsum(step, dtype=np.int32).max(initial=0))


async def refuse(send, status: int, message: str, code: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """Answer with `status` and the endpoints' OpenAI-style error body (APIError's), before the app sees the
    request."""
    from .schemas import APIError  # here: `serve --help` reads this module's defaults without torch
    body = APIError(status, message, code=code).body()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *headers]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


CONNECTION_HEADROOM = 32  # connections past max_connections that still reach the app (/health, its 503s): past
# them uvicorn's limit_concurrency answers its own bare 503


class OpenConnections:
    """The server's open connections, counted by its protocol (`http_protocol`), read by ConnectionLimit."""

    def __init__(self):
        self.count = 0


class ConnectionLimit:
    """ASGI wrapper: a request on a connection past `max_connections` gets a 503 with Retry-After and the API's error
    body, and /health its answer (uvicorn's limit gave both its bare text 503, so that a liveness probe could have
    a server restarted for being busy)."""

    def __init__(self, app, limits: ServerLimits, connections: OpenConnections):
        self.app, self.limits, self.connections = app, limits, connections

    async def __call__(self, scope, receive, send):
        count = self.connections.count
        if scope["type"] == "http" and count > self.limits.max_connections and scope["path"] != "/health":
            await discard_body(scope, receive, self.limits)
            return await refuse(send, 503, f"the server has {count} connections open (at most "
                                f"{self.limits.max_connections}, its --max-connections); retry shortly",
                                "too_many_connections", ((b"retry-after", str(self.limits.retry_after_s).encode()),))
        await self.app(scope, receive, send)


def http_protocol(limits: ServerLimits, connections: OpenConnections | None = None) -> type:
    """uvicorn's h11 protocol with deadlines (`limits.read_timeout_s`) for each request's head and for each response's
    bytes: uvicorn waits for a head forever, so clients that connect and send nothing (or leave without a FIN) held
    every --max-connections slot, and every other client got a 503 until they closed; and it waits forever for a
    client that stops reading (a full socket buffer), so stalled streams held their connections, and their queued
    chunks, as long as their clients kept the socket open. It counts the open ones in `connections`."""
    from uvicorn.protocols.http.h11_impl import H11Protocol
    connections = connections or OpenConnections()

    class HeadDeadline(H11Protocol):
        deadline = writes = None
        unsent = 0  # the bytes the transport held when `writes` was armed

        def connection_made(self, transport):
            connections.count += 1
            super().connection_made(transport)
            self.arm()

        def on_response_complete(self):
            super().on_response_complete()
            self.arm()

        def connection_lost(self, exc):
            connections.count -= 1
            super().connection_lost(exc)
            self.deadline.cancel()
            if self.writes is not None:
                self.writes.cancel()

        def arm(self):
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = self.loop.call_later(limits.read_timeout_s, self.late)

        def late(self):
            if self.cycle is None or self.cycle.response_complete:  # no request under way: its head never came
                self.timeout_keep_alive_handler()  # closes the connection, as uvicorn closes an idle kept-alive one
                if self.transport.get_write_buffer_size():  # a close waits for the last response's unsent bytes
                    self.watch()

        def pause_writing(self):  # the client reads slower than the app writes: the app's sends wait
            super().pause_writing()
            self.watch()

        def resume_writing(self):
            super().resume_writing()
            if self.writes is not None and not self.transport.is_closing():
                self.writes.cancel()
                self.writes = None

        def watch(self):
            """Abort the connection unless the client takes some of its unsent bytes within read_timeout_s (as
            nginx's send_timeout): its stream's generation is cancelled as if it had disconnected."""
            if self.writes is None:
                self.unsent = self.untaken()
                self.writes = self.loop.call_later(limits.read_timeout_s, self.stalled)

        def untaken(self) -> int:
            """Bytes written that the client has not acknowledged: the transport's, and the kernel's send queue
            (Linux's SIOCOUTQ), which holds megabytes and frees room for the transport only in large steps, so that
            a client reading slowly but steadily could move none of the transport's bytes for a long time."""
            size = self.transport.get_write_buffer_size()
            sock = self.transport.get_extra_info("socket")
            if OUTQ is not None and sock is not None:
                with contextlib.suppress(OSError):
                    size += struct.unpack("i", fcntl.ioctl(sock.fileno(), OUTQ, b"\0" * 4))[0]
            return size

        def stalled(self):
            self.writes = None
            size = self.untaken()
            if size and size >= self.unsent:  # not a byte taken: the app adds none while paused or closing
                self.transport.abort()
            elif self.transport.get_write_buffer_size() and (self.flow.write_paused or self.transport.is_closing()):
                self.watch()  # a slow reader, watched on
    return HeadDeadline


async def discard_body(scope, receive, limits: ServerLimits) -> None:
    """Read a request's body and drop it, up to `limits.max_body_bytes` and `read_timeout_s`, before an answer that
    does not read it: a connection closed with the body unread, or with part of it still on its way, is reset by
    the kernel, and the client loses the answer (a refusal read by a client that sent its body after its head). A
    client that waits for "100 Continue" has sent none."""
    if dict(scope.get("headers", ())).get(b"expect", b"").lower() == b"100-continue":
        return
    size = 0
    try:
        async with asyncio.timeout(limits.read_timeout_s):
            while size <= limits.max_body_bytes:
                message = await receive()
                size += len(message.get("body", b""))
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return
    except TimeoutError:
        return


class RequireApiKey:
    """ASGI wrapper: a request without "Authorization: Bearer `key`" gets a 401, its body dropped unparsed;
    /health and /metrics stay open to probes and scrapers, and CORS preflights pass, as vLLM's do."""
    OPEN = ("/health", "/metrics")

    def __init__(self, app, key: str, limits: ServerLimits):
        self.app, self.key, self.limits = app, key.encode(), limits

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN and scope["method"] != "OPTIONS":
            scheme, _, sent = dict(scope.get("headers", ())).get(b"authorization", b"").partition(b" ")
            # in constant time: the key is not guessed byte by byte (the scheme's name is case-insensitive in HTTP)
            if scheme.lower() != b"bearer" or not hmac.compare_digest(sent.strip(), self.key):
                await discard_body(scope, receive, self.limits)
                return await refuse(send, 401, "the API key is missing or wrong; send Authorization: Bearer KEY with "
                                    "the key the server was started with (--api-key)", "invalid_api_key",
                                    ((b"www-authenticate", b"Bearer"),))
        await self.app(scope, receive, send)


class BodyLimits:
    """ASGI wrapper: a POST body over `max_body_bytes` (by its Content-Length, or as it arrives) gets a 413,
    one nested deeper than `max_json_depth` a 400, one of a Content-Encoding (gzip, br, ...) a 415; others reach
    `app` as JSON, whatever their Content-Type says (as llama-server reads them: `curl -d` labels a body
    application/x-www-form-urlencoded, and one without the header was a 400)."""

    def __init__(self, app, limits: ServerLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        limit, headers = self.limits.max_body_bytes, dict(scope.get("headers", ()))
        coding = headers.get(b"content-encoding", b"identity").strip().lower()
        if coding not in (b"identity", b""):  # a gzip body read as JSON was a misleading 400, a plain one labelled
            await discard_body(scope, receive, self.limits)  # gzip a 200: neither is what the client sent
            return await refuse(send, 415, f"a request body of Content-Encoding {coding.decode('latin-1')!r} is not "
                                "taken; send it uncompressed, without the header", "unsupported_media_type",
                                ((b"accept-encoding", b"identity"),))
        declared = headers.get(b"content-length", b"0")
        too_big = f"the request body is over {limit} bytes; send a smaller one (the server's --max-body-bytes)"
        if declared.isdigit() and int(declared) > limit:
            return await refuse(send, 413, too_big, "body_too_large")
        chunks, size, more = [], 0, True
        try:
            async with asyncio.timeout(self.limits.read_timeout_s):  # a client that stalls frees its connection
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    more = message.get("more_body", False)
                    if size > limit:
                        return await refuse(send, 413, too_big, "body_too_large")
        except TimeoutError:
            return await refuse(send, 408, f"the request body did not arrive within {self.limits.read_timeout_s:g} s; "
                                "send it whole", "request_timeout", ((b"connection", b"close"),))
        body = b"".join(chunks)
        if json_depth(body) > self.limits.max_json_depth:
            return await refuse(send, 400, f"the body nests arrays and objects more than "
                                f"{self.limits.max_json_depth} deep; flatten it", "body_too_deep")
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if kind != b"application/json" and not kind.endswith(b"+json"):
            scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", ()) if k != b"content-type"] +
                     [(b"content-type", b"application/json")]}
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, replay, send)
