"""The HTTP app of `lmc runtime`: assembles the routes (lmi_api, openai_api) over a core.Runtime and
serves them with uvicorn, draining on SIGTERM/SIGINT.

Nothing imports this module but the CLI and tests: the routes depend on core.py and jobs.py (see
core.py for the layout). The names re-exported below are where they used to live.
"""

from __future__ import annotations

import logging
import signal
import socket
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from lmc.runtime.core import DEFAULT_MAX_BODY_BYTES, INLINE_TOKENIZE_CHARS, Runtime, error_response
from lmc.runtime.jobs import CLIENT_CLOSED, Job, RequestFailed
from lmc.runtime.lmi_api import lmi_routes
from lmc.runtime.openai_api import openai_routes

log = logging.getLogger("lmc.runtime")

_STOP_NOW_GRACE_S = 2.0  # for handlers to send their 503 when the server stops now (see make_server)

__all__ = ["CLIENT_CLOSED", "DEFAULT_MAX_BODY_BYTES", "INLINE_TOKENIZE_CHARS", "Job", "RequestFailed", "Runtime",
           "create_app", "listen_socket", "make_server", "serve"]


async def _not_found(request: Request, exc: HTTPException) -> Response:
    response = error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    response.headers.update(exc.headers or {})  # a 405's Allow
    return response


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s", request.url.path)
    runtime: Runtime = request.app.state.runtime
    runtime.record(request.url.path.strip("/").replace("/", "_") or "root", 500)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")



def create_app(runtime: Runtime) -> Starlette:
    """The ASGI app: the LMI and OpenAI routes over `runtime`."""

    @asynccontextmanager
    async def lifespan(app):
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    app = Starlette(routes=[*lmi_routes(), *openai_routes()], lifespan=lifespan,
                    exception_handlers={HTTPException: _not_found, Exception: _unexpected})
    app.state.runtime = runtime
    return app


# ---------------------------------------------------------------- serving

def serve(runtime: Runtime, host: str, port: int, drain_timeout_s: float | None = None,
          sock: socket.socket | None = None) -> bool:
    """Run the app until SIGTERM/SIGINT: then answer 503 to new work, let in-flight requests finish
    (up to `drain_timeout_s`), stop the worker groups and return False. A second SIGINT during the drain
    cuts it short (the requests still in flight are answered 503): then True. `sock`: the listening socket,
    bound already (listen_socket), else uvicorn binds host:port itself."""
    server = make_server(runtime, host, port, drain_timeout_s)
    server.run(sockets=[sock] if sock is not None else None)
    return server.cut_short


def listen_socket(host: str, port: int) -> socket.socket:
    """The HTTP server's socket, bound to host:port before the model loads: an address in use or a host that
    does not resolve is one line (exit 1) at once, not uvicorn's error (exit 3) after minutes of loading.
    Not inherited by the ranks (spawned, or forked from a fork server started by exec)."""
    from lmc.errors import LmcError

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise LmcError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own bind
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise LmcError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def make_server(runtime: Runtime, host: str, port: int, drain_timeout_s: float | None = None):
    """The uvicorn server for `runtime`, draining on SIGTERM/SIGINT (signals are only captured when
    it runs in the main thread; tests run it in a thread and set `should_exit`)."""
    import uvicorn

    drain_timeout_s = runtime.request_timeout_s if drain_timeout_s is None else drain_timeout_s

    class DrainingServer(uvicorn.Server):
        draining = False
        cut_short = False  # by a second Ctrl-C: serve() says so
        stopping_now = False

        def handle_exit(self, sig: int, frame) -> None:
            # Not uvicorn's: it closes the socket at once and re-raises the signal at exit (so the
            # process would not exit 0). We keep answering 503 while in-flight requests finish.
            loop = runtime.loop
            if self.draining:
                # A second Ctrl-C stops now, as uvicorn's does. A repeated SIGTERM does not: container
                # runtimes resend it, and their SIGKILL ends a drain that takes too long.
                if sig == signal.SIGINT and not self.cut_short:
                    self.cut_short = True
                    if loop is None:
                        self.should_exit = True
                    else:
                        loop.call_soon_threadsafe(lambda: loop.create_task(self._stop_now("second interrupt")))
                return
            self.draining = True
            if loop is None:
                self.should_exit = True
                return
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

        async def _drain(self) -> None:
            runtime.begin_drain()
            if not await runtime.wait_idle(drain_timeout_s):
                await self._stop_now(f"drain timed out after {drain_timeout_s:g}s")
            self.should_exit = True

        async def _stop_now(self, why: str) -> None:
            """Answer every request still queued or generating 503 (a stream: its error event), let the
            handlers send that, then stop: no request is cut off without a word, and no handler dies
            cancelled, with a traceback in the log. (uvicorn's force_exit would also skip the lifespan
            shutdown that stops the worker groups.)"""
            if self.stopping_now:
                return
            self.stopping_now = True
            log.warning("%s: stopping now; %d request(s) in flight are answered 503", why, runtime._in_flight)
            runtime.scheduler.fail_all(503, f"the server stopped ({why}) before this request finished")
            await runtime.wait_idle(_STOP_NOW_GRACE_S)
            self.should_exit = True

    config = uvicorn.Config(create_app(runtime), host=host, port=port, lifespan="on", access_log=False,
                            log_level="info", timeout_graceful_shutdown=5, timeout_keep_alive=5)
    server = DrainingServer(config)

    def stop_serving() -> None:  # a group cannot load the model: nothing will ever be served
        runtime.accepting = False
        server.should_exit = True

    runtime.scheduler.on_fatal_hook = stop_serving
    return server
