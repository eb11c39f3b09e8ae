"""The server's errors: :class:`ServeError` (an HTTP status and OpenAI's error body) and :class:`ClientGone` (the
client left before its body arrived); :func:`error_response` answers one, counted in the metrics."""

from starlette.responses import JSONResponse

__all__ = ["ServeError", "ClientGone", "RETRY_AFTER_503", "error_response", "one_line"]

#: the Retry-After of every 503 (the server is draining: a client retries elsewhere or after a restart)
RETRY_AFTER_503 = "5"


class ServeError(Exception):
    """An error with an HTTP status and an OpenAI error body."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
             404: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
             429: "rate_limit_error", 499: "request_cancelled", 503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None) -> None:
        message, param = one_line(message), None if param is None else one_line(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}



class ClientGone(ServeError):
    """The client closed the connection before its request body arrived: nobody reads the answer (HTTP 499,
    counted, never a traceback)."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection before its request body arrived",
                         code="client_closed_request")



def one_line(text: str, limit: int = 600) -> str:
    """``text`` as one line of valid UTF-8 (a lone surrogate from a JSON escape is written ``\\udXXX``: it cannot
    be encoded, and a response that cannot be encoded was a 500), at most ``limit`` characters."""
    text = str(text).replace("\r", " ").replace("\n", " ")
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def error_response(e: ServeError, route: str, metrics=None) -> JSONResponse:
    """``e`` as a JSON response (a 503 without headers gets Retry-After), counted under ``route`` in
    ``metrics`` (a :class:`~expertcache.serve.metrics.Metrics`) when given."""
    if metrics is not None:
        metrics.requests.labels(route, str(e.status)).inc()
    headers = e.headers
    if e.status == 503 and not headers:  # draining or stopped: when to come back (another instance, maybe)
        headers = {"Retry-After": RETRY_AFTER_503}
    return JSONResponse(e.body(), status_code=e.status, headers=headers)
