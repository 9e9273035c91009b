"""expertcache serve: an OpenAI-compatible HTTP server over one engine and one expert cache."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import threading

from ..errors import ExpertCacheError
from ..serve.limits import CONNECTION_HEADROOM, ServerLimits, http_protocol
from .options import add_engine_arguments, bounded, engine_from_args, positive_int

HELP = "serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)"


def port(text: str) -> int:
    """A TCP port number, 0 (any free one) to 65535 (argparse type)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; give a number from 0 to 65535, e.g. --port 8000")
    return n


def model_name(text: str) -> str:
    """A non-empty model id (argparse type)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the served model name is empty; give one, e.g. --served-model-name my-model")
    return text


def api_key(text: str) -> str:
    """A key that an HTTP header can carry: printable ASCII without spaces (argparse type)."""
    if not text or not all("!" <= c <= "~" for c in text):
        raise argparse.ArgumentTypeError("the API key (--api-key or $EXPERTCACHE_API_KEY) is empty or has spaces or "
                                         "characters outside printable ASCII; give one such as "
                                         "--api-key $(openssl rand -hex 16)")
    return text


def add_arguments(p):
    """The verb's options."""
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=port, default=8000, help="TCP port (0: any free one)")
    p.add_argument("--served-model-name", type=model_name, default=None,
                   help="the model id clients send (default: expertcache-builtin for the built-in model, else the "
                        "checkpoint folder's name)")
    p.add_argument("--schedule", default="batch",
                   help="batch: the decode steps of active requests run as one batched forward; interleave: they "
                        "take turns, one forward each; serial: one request at a time")
    p.add_argument("--max-active", type=positive_int, default=16, help="requests decoding at once under batch or interleave")
    p.add_argument("--kv-positions", type=positive_int, default=None,
                   help="positions of keys and values held for the active requests together, counted in "
                        "--memory-budget; a request is admitted while its prompt + max_tokens fit, else it waits "
                        "(default: --max-seq x --max-active, or --max-seq under serial)")
    p.add_argument("--max-active-per-request", type=positive_int, default=None,
                   help="slots one call's choices and prompts may hold at once (default: half of --max-active)")
    p.add_argument("--max-waiting", type=positive_int, default=ServerLimits.max_waiting,
                   help="requests waiting for a slot; more get 429 with Retry-After")
    p.add_argument("--responses-kept", default=ServerLimits.responses_kept,
                   type=bounded(int, 0, 10**6, what="give a count in [0, 1000000], e.g. 256 (0: keep none)"),
                   help="the last /v1/responses answers kept in memory (at most 64 MiB of them), which a request "
                        "continues by previous_response_id; 0 keeps none")
    p.add_argument("--max-connections", type=positive_int, default=ServerLimits.max_connections,
                   help="open connections; requests on more get 503 with Retry-After (/health is answered)")
    p.add_argument("--max-body-bytes", type=positive_int, default=ServerLimits.max_body_bytes,
                   help="bytes of a request body; larger get 413")
    p.add_argument("--allowed-origins", nargs="*", default=list(ServerLimits.allowed_origins), metavar="ORIGIN",
                   help="web origins a browser may call the API from (CORS; default: any, as vLLM's and llama.cpp's "
                        "servers; none: no CORS headers)")
    p.add_argument("--api-key", type=api_key, default=os.environ.get("EXPERTCACHE_API_KEY"),
                   help="requests must send 'Authorization: Bearer KEY', else 401 (/health and /metrics stay open); "
                        "default: $EXPERTCACHE_API_KEY, which keeps the key out of the process list")
    p.add_argument("--read-timeout", default=ServerLimits.read_timeout_s,
                   type=bounded(float, 0, 86400, lo_open=True, what="give seconds in (0, 86400], e.g. 30"),
                   help="seconds a client may take to send a request's head (else the connection closes) and its body "
                        "(else 408), and to take some of a response's bytes (else it is cut off and its generation "
                        "cancelled)")
    p.add_argument("--shutdown-timeout", type=bounded(float, 0, what="give seconds >= 0, e.g. 5"), default=5.0,
                   help="seconds that requests still running may take to end after SIGTERM or Ctrl-C; then they are "
                        "ended with a 503 (a stream with an error chunk and [DONE]; within the 10 s a container "
                        "runtime waits before it kills; inf: wait for them)")
    p.add_argument("--reasoning-format", choices=("auto", "none"), default="auto",
                   help="auto: a reasoning model's thoughts come back in reasoning_content, apart from its answer; "
                        "none: the text as the model wrote it (a request's reasoning_format overrides it)")
    p.add_argument("--prefill-policy", default="same",
                   help="miss policy for prompt tokens ('same': the decode policy); e.g. substitute-all keeps "
                        "a long prompt from flushing the experts decoding uses")
    p.add_argument("--prefill-chunk", type=bounded(int, 0, what="give a whole number >= 0"), default=512,
                   help="prompt tokens a round runs of one request while others decode, so that their tokens keep "
                        "coming during a long prompt (0: each prompt whole); alone, a prompt runs whole")


def build_app(a):
    """The engine, scheduler and ASGI app for parsed serve arguments."""
    from ..engine.checkpoint import model_name
    from ..errors import FetchError
    from ..policies import make_policy
    from ..serve.access_log import AccessLog
    from ..serve.app import create_app
    from ..serve.scheduler import Scheduler, SchedulerConfig
    prefill = None if a.prefill_policy == "same" else make_policy(a.prefill_policy)
    config = SchedulerConfig(schedule=a.schedule, max_active=a.max_active, prefill_policy=prefill,
                             max_per_group=a.max_active_per_request, prefill_chunk=a.prefill_chunk)
    if a.kv_positions is None:
        a.kv_positions = a.max_seq * (1 if a.schedule == "serial" else a.max_active)
    engine = engine_from_args(a)
    name = a.served_model_name or (model_name(engine.path) if a.model else "expertcache-builtin")
    limits = ServerLimits(max_body_bytes=a.max_body_bytes, max_waiting=a.max_waiting,
                          max_connections=connections_within_open_files(a.max_connections),
                          allowed_origins=tuple(a.allowed_origins),
                          api_key=a.api_key, read_timeout_s=a.read_timeout, responses_kept=a.responses_kept)
    try:
        scheduler = Scheduler(engine, config)
        scheduler.warm_up()  # a first run compiles here, under the notice, not in the first request
        app = create_app(scheduler, name, limits, a.reasoning_format)
    except BaseException:  # the engine's store, ring and threads go with the failed start
        engine.close()
        raise
    app.add_middleware(AccessLog, log=lambda line: print(f"expertcache: {line}", file=sys.stderr, flush=True))
    app.state.server.scheduler.on_error = lambda request, e: print(
        f"expertcache: a request failed: {type(e).__name__}: {e}" + (
            "; after converting the store again, restart the server (it holds the old file open)"
            if isinstance(e, FetchError) else ""), file=sys.stderr, flush=True)
    return app


FILE_HEADROOM = 16  # files a serving process opens past its connections and what it holds once loaded


def connections_within_open_files(wanted: int) -> int:
    """--max-connections, within the files the process may open (each connection is one): the soft limit is raised
    toward the hard one for them; where the hard one is short, fewer are served, said in one line. Past its open
    files every accept failed and asyncio wrote a traceback for each, thousands a second."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = FILE_HEADROOM
    need = used + FILE_HEADROOM + wanted + CONNECTION_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    room = wanted if soft == resource.RLIM_INFINITY else \
        min(wanted, soft - used - FILE_HEADROOM - CONNECTION_HEADROOM)  # the files left for connections
    if room < 1:
        raise ExpertCacheError(f"only {soft} open files are allowed (ulimit -n), {used} of them in use: too few "
                               "to serve; raise the limit, e.g. ulimit -n 1024")
    if room < wanted:
        print(f"expertcache: {soft} open files are allowed (ulimit -n): at most {room} connections at once, not "
              f"--max-connections {wanted}; requests on more get a 503 (raise the limit for more)", file=sys.stderr)
    return room


def quiet_accept_failures(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The event loop's exception handler: a listening socket that cannot accept (out of open files, or of memory
    for sockets) is said in one line every ten seconds, not a traceback per try; the waiting clients stay in the
    backlog until connections close. Each failed accept leaves a retry a second later, thousands of them, which
    fail once the server has closed its socket: said by nobody. Anything else as asyncio reports it."""
    if getattr(getattr(context.get("handle"), "_callback", None), "__name__", None) == "_start_serving" and \
            isinstance(context.get("exception"), (ValueError, OSError)):  # its socket closed (fd -1): stopped
        return None
    if context.get("message") != "socket.accept() out of system resource":
        return loop.default_exception_handler(context)
    now = loop.time()
    if now - getattr(quiet_accept_failures, "said", -10.0) >= 10.0:
        quiet_accept_failures.said = now
        e = context.get("exception")
        print(f"expertcache: cannot accept connections ({getattr(e, 'strerror', None) or e}); clients wait until "
              "some close (raise ulimit -n or lower --max-connections)", file=sys.stderr, flush=True)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a taken port fails fast. It listens at once: a
    client that connects as soon as the "serving" line appears waits in its backlog, not refused, until uvicorn
    accepts."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's backlog
    except OSError as e:
        raise ExpertCacheError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port "
                               "or --host") from None
    return sock


def run(a) -> int:
    """Run the verb; returns the exit code: 1 when uvicorn failed or the engine's worker stopped on an error it
    cannot recover from (so that a supervisor restarts the server), else 0. Ctrl-C and SIGTERM shut it down, then
    uvicorn raises the signal again: 130 (cli.main), or death by SIGTERM, as a supervisor expects."""
    import uvicorn
    sock = bind(a.host, a.port)
    app = build_app(a)
    scheduler = app.state.server.scheduler
    limits = app.state.server.limits
    grace = None if a.shutdown_timeout == float("inf") else a.shutdown_timeout

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            asyncio.get_running_loop().set_exception_handler(quiet_accept_failures)
            await super().startup(sockets)

        async def shutdown(self, sockets=None):
            # the requests still running when the grace ends: uvicorn cancels their tasks, which cut a stream off
            # without a word (and logged a traceback); ended by the worker a little before, a stream sends its 503
            # chunk and [DONE], a whole answer its 503, and the connections close in time
            if grace is not None:
                asyncio.get_running_loop().call_later(max(0.0, grace - min(1.0, grace / 4)), scheduler.stop, False)
            await super().shutdown(sockets)

    server = Server(uvicorn.Config(app, log_level="warning",
                                   limit_concurrency=limits.max_connections + CONNECTION_HEADROOM,
                                   timeout_graceful_shutdown=grace, http=http_protocol(limits, app.state.connections)))
    scheduler.on_fatal = lambda e: setattr(server, "should_exit", True)
    bound = sock.getsockname()[1]  # the port the system chose for --port 0
    keyed = " (requests need the API key)" if limits.api_key is not None else ""
    print(f"expertcache: serving {app.state.server.model_name!r} on http://{a.host}:{bound}/v1{keyed}",
          file=sys.stderr)
    hung_up = []  # a hang-up drains the server as SIGTERM does (uvicorn handles only SIGINT and SIGTERM: a SIGHUP
    # cut the requests in flight off with tracebacks), then the process dies of it; one ignored (nohup) stays so
    previous = signal.getsignal(signal.SIGHUP) or signal.SIG_DFL  # None: a handler set in C
    catch = previous != signal.SIG_IGN and threading.current_thread() is threading.main_thread()  # where it may
    if catch:
        signal.signal(signal.SIGHUP, lambda signum, frame: (hung_up.append(signum),
                                                            setattr(server, "should_exit", True)))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        scheduler.stop()
        app.state.server.engine.close()
        if catch:
            signal.signal(signal.SIGHUP, previous)
    if hung_up:  # drained: now as the handler before (the command line's unwinds, then dies of it)
        signal.raise_signal(signal.SIGHUP)
    if scheduler.failure is not None:
        print(f"expertcache: error: the engine stopped ({scheduler.state}); restart the server", file=sys.stderr)
        return 1
    if not server.started:  # uvicorn gave up before serving (the app's startup failed)
        print("expertcache: error: the server did not start; see the log above", file=sys.stderr)
        return 1
    return 0
