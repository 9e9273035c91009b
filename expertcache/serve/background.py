"""Run the server's ASGI app under uvicorn in a background thread on a loopback port
(tests and the load benchmark)."""
from __future__ import annotations

import socket
import threading
import time

import uvicorn

from .limits import http_protocol


class BackgroundServer:
    """with BackgroundServer(app) as s: s.base_url -> http://127.0.0.1:PORT/v1"""

    def __init__(self, app, host: str = "127.0.0.1"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))  # a free port, held from here on: no race with other processes
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    http=http_protocol(app.state.server.limits,
                                                                       app.state.connections)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        """The server's root, http://HOST:PORT."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI API root, http://HOST:PORT/v1."""
        return f"{self.url}/v1"

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.sock.close()
