"""Who may talk to `k3 serve`: the Host header a request names, and the web page (Origin) it comes from.

A page in a browser can send a "simple" cross-origin POST (Content-Type text/plain) to any address, a local
server's included, without asking first; and DNS rebinding lets a page's own host name point at 127.0.0.1.
So a request whose Host is not one of `allowed_hosts` gets 400, and a request that carries an Origin header
(every browser POST does; curl and the OpenAI clients send none) gets 403 unless that origin is in
`allowed_origins`, for which CORS headers are sent (Starlette's CORSMiddleware answers their preflights).
"""

from __future__ import annotations

from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import JSONResponse

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """Loopback names for a server bound to loopback (DNS rebinding defence); any host otherwise."""
    return LOOPBACK_HOSTS if bind_host in LOOPBACK_HOSTS else ("*",)


class _OriginCheck:
    """Pure ASGI middleware: 403 for a request from a web page whose origin is not allowed."""

    def __init__(self, app, allowed_origins: tuple[str, ...]) -> None:
        self.app, self.allowed = app, set(allowed_origins)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and "*" not in self.allowed:
            origin = dict(scope["headers"]).get(b"origin")
            if origin is not None and origin.decode("latin-1") not in self.allowed:
                text = origin.decode("latin-1")[:200]
                body = {"error": {"message": f"requests from web pages at {text} are refused (a page could "
                                             f"otherwise drive this server); start k3 serve with "
                                             f"--allowed-origins {text} to allow them",
                                  "type": "permission_error", "param": None, "code": "origin_not_allowed"}}
                await JSONResponse(body, status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def add_origin_checks(app, allowed_origins: tuple[str, ...] = (),
                      allowed_hosts: tuple[str, ...] = ("*",)) -> None:
    """Wrap a Starlette/FastAPI app: Host check (outermost), CORS for allowed_origins, the Origin check."""
    app.add_middleware(_OriginCheck, allowed_origins=tuple(allowed_origins))
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    if "*" not in allowed_hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))
