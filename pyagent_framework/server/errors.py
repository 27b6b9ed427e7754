"""The one error shape every endpoint returns: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` with a fitting HTTP status."""

from __future__ import annotations

from http import HTTPStatus

from pyagent_framework.server.protocol import ErrorInfo, ErrorResponse

# Status -> the OpenAI error type clients switch on.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "server_error",
    500: "server_error",
}


class APIError(Exception):
    """An error answered to the client, never a crash."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or HTTPStatus(status).phrase.lower().replace(" ", "_")

    def body(self) -> ErrorResponse:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> ErrorResponse:
    return ErrorResponse(
        error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "invalid_request_error"), param=param, code=code)
    )


# Documented on every route, so /openapi.json says what each status carries.
ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in {
        400: "Invalid request: a field has a bad value or exceeds a cap",
        401: "Missing or wrong API key",
        404: "Unknown model",
        413: "Request body too large",
        422: "Request body does not match the schema",
        503: "The engine has stopped",
    }.items()
}
