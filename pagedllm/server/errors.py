"""OpenAI-style error responses.

Body shape follows the OpenAI API: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error to send to the client as an OpenAI error body.

    Args:
        status: HTTP status (400, 401, 404, 503, ...).
        message: human-readable explanation.
        param: the request field at fault, if any.
        type: OpenAI error type (``invalid_request_error``, ...).
        code: short machine-readable code.
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        """The JSON body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """As a FastAPI response."""
        return JSONResponse(self.body(), status_code=self.status)


def validation_error(exc) -> APIError:
    """Turn a pydantic/FastAPI ``RequestValidationError`` into a 400 naming the first bad field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request", code="invalid_request")
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('msg')}", None, code="invalid_json")
    msg = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
    return APIError(400, msg, param, code="invalid_value")
