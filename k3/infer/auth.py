"""Optional API keys for `k3 serve`: with a key set, every /v1/ route needs `Authorization: Bearer <key>`
(as OpenAI's clients send it); anything else is a 401 in OpenAI's error shape. /health and /metrics stay open
for probes. The key is compared in constant time."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from k3.infer.protocol import APIError


def require_api_key(app: FastAPI, api_key: str) -> None:
    expected = f"Bearer {api_key}".encode("utf-8")

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").encode("utf-8")
            if not hmac.compare_digest(given, expected):
                what = "no API key was given" if not given else "the API key is not valid"
                error = APIError(f"{what}; send it as the header 'Authorization: Bearer <key>' (the key the "
                                 f"server was started with: --api-key or K3_API_KEY)", status=401,
                                 code="invalid_api_key", type="invalid_request_error")
                return JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)
