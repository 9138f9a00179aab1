"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: ``APIError`` (raised
by the handlers, answered by the app's exception handler), and the errors a stream ends with."""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel

from fuseformer.engine.async_engine import EngineDeadError, EngineShutdownError

logger = logging.getLogger("fuseformer.serve")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``, as OpenAI returns it."""

    error: ErrorInfo


class APIError(Exception):
    """An error to return to the client in OpenAI's shape (400 unless said otherwise)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        # A message may quote the client's text: a lone surrogate there ("\ud800") would make the
        # response's UTF-8 encoding fail, a 500. It is written as its escape instead.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def encode(self) -> bytes:
        return json.dumps(self.body(), ensure_ascii=False).encode()


def model_not_found(model: str, served: str) -> APIError:
    """404 ``model_not_found``, as OpenAI and vLLM answer for a model the server does not serve."""
    return APIError(
        f"The model {model!r} does not exist; this server serves {served!r}",
        "model",
        status=404,
        code="model_not_found",
    )


def unavailable(message: str) -> APIError:
    return APIError(message, None, status=503, type="service_unavailable_error")


def shutdown_error() -> APIError:
    """A request the shutdown timeout ended unfinished."""
    return APIError(
        "the server shut down before the request finished (serve --shutdown-timeout)",
        None,
        status=503,
        type="service_unavailable_error",
        code="server_shutdown",
    )


def stream_error(exc: Exception) -> APIError:
    """The SSE error event of an exception raised while a response streams."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (EngineDeadError, EngineShutdownError)):
        return unavailable(str(exc))
    logger.error("error while streaming a response", exc_info=exc)
    return APIError(f"{type(exc).__name__}: {exc}", None, status=500, type="internal_server_error")
