"""One line per HTTP request, as llama-server and vLLM log them: method, path, status, prompt and completion
tokens (from the response's usage, or a stream's count that the server leaves in the request's state), and
milliseconds: `POST /v1/chat/completions -> 200, 21 prompt + 64 completion tokens, 812 ms`."""
from __future__ import annotations

import re
import time
from collections.abc import Callable

USAGE = re.compile(rb'"prompt_tokens":\s*(\d+),\s*"completion_tokens":\s*(\d+)')
TAIL = 4096  # bytes of a response kept to find its usage (the last JSON object or SSE chunk)


class AccessLog:
    """ASGI middleware: calls `log(line)` once each request has been answered (or has failed)."""

    def __init__(self, app, log: Callable[[str], None]):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # 499 (nginx's): the app ended without an answer, which it does only for a client that left before its
        # body came; it was logged as a 500, a fault of the server's. A raised failure is a 500.
        start, status, tail = time.perf_counter(), [499], [b""]

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body":
                tail[0] = (tail[0] + message.get("body", b""))[-TAIL:]
            await send(message)
        try:
            await self.app(scope, receive, send_and_note)
        except BaseException:
            if status[0] == 499:
                status[0] = 500
            raise
        finally:
            found = [tuple(map(int, pair)) for pair in USAGE.findall(tail[0])] or \
                [scope.get("state", {}).get("usage")]  # a stream's, which need not carry one
            tokens = f", {found[-1][0]} prompt + {found[-1][1]} completion tokens" if found[-1] else ""
            self.log(f"{scope['method']} {scope['path']} -> {status[0]}{tokens}, "
                     f"{1e3 * (time.perf_counter() - start):.0f} ms")
