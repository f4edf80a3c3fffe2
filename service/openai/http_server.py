"""uvicorn serving the HTTP API inside the gRPC server's event loop.

`uvicorn.Server.serve` would install its own SIGTERM handler and own the loop; here
the server process owns both, so the pieces of `serve` run separately: bind, start,
tick (uvicorn refreshes its Date header once a second), and shut down on request.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

log = logging.getLogger("pagedinfer.http")

BACKLOG = 2048


class HttpServer:
    """One uvicorn server of `app` on host:port (port 0 picks a free one), TLS when
    given a certificate and key."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        import uvicorn

        self.host, self.requested_port = host, port
        self.config = uvicorn.Config(
            app,
            log_config=None,  # the server's JSON logging stays in charge
            access_log=False,
            lifespan="off",
            server_header=False,
            ssl_certfile=tls_cert,
            ssl_keyfile=tls_key,
            backlog=BACKLOG,
        )
        self.server = uvicorn.Server(self.config)
        self.port: int | None = None
        self._socket: socket.socket | None = None
        self._ticks: asyncio.Task | None = None

    async def start(self) -> int:
        """Binds and starts serving; returns the bound port. OSError if the port is taken
        or the certificate cannot be read."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._socket = socket.create_server(
            (self.host, self.requested_port), family=family, backlog=BACKLOG
        )
        try:
            self.config.load()  # reads the TLS certificate
        except (OSError, ValueError) as exc:
            self._socket.close()
            raise OSError(f"cannot load the TLS certificate for HTTP: {exc}") from exc
        self.server.lifespan = self.config.lifespan_class(self.config)  # "off": a no-op
        self.port = self._socket.getsockname()[1]
        await self.server.startup(sockets=[self._socket])
        self._ticks = asyncio.get_running_loop().create_task(
            self.server.main_loop(), name="http-ticks"
        )
        return self.port

    async def stop(self, timeout: float) -> None:
        """Stops listening and closes idle connections; responses still running get
        `timeout` seconds, then they are cancelled (which aborts their requests)."""
        if self._ticks is None:
            return
        self.server.should_exit = True
        await self._ticks
        self._ticks = None
        self.config.timeout_graceful_shutdown = max(timeout, 0.1)
        await self.server.shutdown(sockets=[self._socket] if self._socket else None)
