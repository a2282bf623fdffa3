"""Exception classes of libdsec.

Every error the SDK raises derives from :class:`DSecError`. Errors answered by
the API carry its error code (``.code``, e.g. ``"not_found"``), its message
(``.message``) and the HTTP status (``.status``; 0 for an error reported
inside a stream or raised by the client itself). The class is chosen from the
code, so callers can write ``except libdsec.QuotaExceeded:``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

__all__ = [
    "DSecError",
    "InvalidArgument",
    "Unauthenticated",
    "PermissionDenied",
    "NotFound",
    "SandboxNotFound",
    "AlreadyExists",
    "FailedPrecondition",
    "QuotaExceeded",
    "CapacityExhausted",
    "Unavailable",
    "InternalError",
    "ConnectionFailed",
    "DeadlineExceeded",
    "ProtocolError",
    "ConfigError",
    "UnsafeArchive",
    "BatchFailed",
    "NodesUnreachable",
    "error_from_code",
    "error_from_response",
]


class DSecError(Exception):
    """Base class of every libdsec error.

    Attributes:
        code: The API error code (``invalid_argument``, ``not_found``, ...),
            or a client-side code for errors the client raises itself.
        message: Human-readable text, as the server wrote it.
        status: HTTP status of the answer; 0 when there was none.
        method: HTTP method of the failed call, when known.
        path: Request path of the failed call, when known.
    """

    #: Code carried by instances of this class unless another is given.
    default_code = ""

    def __init__(
        self,
        message: str = "",
        *,
        code: Optional[str] = None,
        status: int = 0,
        method: Optional[str] = None,
        path: Optional[str] = None,
    ) -> None:
        self.code = code if code is not None else self.default_code
        self.message = message
        self.status = status
        self.method = method
        self.path = path
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.code and self.message:
            return f"{self.code}: {self.message}"
        if self.message:
            return self.message
        if self.code:
            return self.code
        return f"HTTP {self.status}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, status={self.status}, message={self.message!r})"

    def __reduce__(self):  # keeps errors picklable (multiprocessing RL workers)
        return (_rebuild, (type(self), self.message, self.code, self.status, self.method, self.path))


def _rebuild(cls: type, message: str, code: str, status: int, method: Any, path: Any) -> "DSecError":
    return cls(message, code=code, status=status, method=method, path=path)


class InvalidArgument(DSecError):
    """The request is malformed or a value is out of range (400)."""

    default_code = "invalid_argument"


class Unauthenticated(DSecError):
    """The API key is missing or unknown (401)."""

    default_code = "unauthenticated"


class PermissionDenied(DSecError):
    """The API key may not do this (403)."""

    default_code = "permission_denied"


class NotFound(DSecError):
    """The sandbox, session, file or layer does not exist (404)."""

    default_code = "not_found"


class SandboxNotFound(NotFound):
    """The sandbox named in the call does not exist (any more)."""


class AlreadyExists(DSecError):
    """The name is taken, e.g. a layer ref (409)."""

    default_code = "already_exists"


class FailedPrecondition(DSecError):
    """The object is in the wrong state for the call, or the call uses a
    feature this server or node does not provide (409). For example, an
    allow rule on a node whose sandbox networking is off."""

    default_code = "failed_precondition"


class QuotaExceeded(DSecError):
    """The project's quota forbids the request (429)."""

    default_code = "quota_exceeded"


class CapacityExhausted(DSecError):
    """No node can hold the request right now (503 resource_exhausted)."""

    default_code = "resource_exhausted"


class Unavailable(DSecError):
    """A node or dependency cannot be reached right now; retry later (503)."""

    default_code = "unavailable"


class InternalError(DSecError):
    """An unexpected server error (500); the message holds a reference to
    the server log."""

    default_code = "internal"


class ConnectionFailed(Unavailable):
    """The client could not reach the server, or the connection broke before
    a complete answer arrived (no HTTP status)."""


class DeadlineExceeded(DSecError, TimeoutError):
    """The call did not finish within its timeout. Also a ``TimeoutError``."""

    default_code = "deadline_exceeded"


class ProtocolError(DSecError):
    """The server's answer could not be understood (bad HTTP framing or JSON)."""

    default_code = "protocol_error"


class ConfigError(DSecError):
    """The client configuration (endpoint, config file) is unusable."""

    default_code = "invalid_config"


class UnsafeArchive(DSecError):
    """A downloaded tar archive has an entry that would land outside the
    target directory (absolute path, ``..``, or a link pointing out), or a
    device file. Nothing was extracted."""

    default_code = "unsafe_archive"


class BatchFailed(DSecError):
    """Some items of a batch create or fork failed.

    Raised by the all-or-nothing helpers (``run_containers``, ``fork``): the
    sandboxes that were created have already been deleted. ``errors`` holds
    ``(index, DSecError)`` pairs; the exception's own code and message are
    those of the first failure.
    """

    def __init__(self, message: str = "", *, errors: Optional[list] = None, **kw: Any) -> None:
        self.errors: list = list(errors or [])
        super().__init__(message, **kw)


class NodesUnreachable(Unavailable):
    """A call by labels (``delete``, ``pause``, ``resume``) could not ask
    some nodes (down or cut off): their sandboxes were left as they are.

    ``count`` is how many sandboxes the call did handle on the other nodes,
    ``nodes`` the names of those it could not ask. Sending the call again
    once they are back finishes the job.
    """

    def __init__(self, message: str = "", *, count: int = 0, nodes: Optional[list] = None, **kw: Any) -> None:
        self.count = count
        self.nodes: list = list(nodes or [])
        super().__init__(message, **kw)

    def __reduce__(self):
        return (_rebuild_unreachable, (self.message, self.count, self.nodes, self.code, self.status, self.method, self.path))


def _rebuild_unreachable(message: str, count: int, nodes: list, code: str, status: int, method: Any, path: Any) -> "NodesUnreachable":
    return NodesUnreachable(message, count=count, nodes=nodes, code=code, status=status, method=method, path=path)


_BY_CODE: dict[str, type[DSecError]] = {
    "invalid_argument": InvalidArgument,
    "unauthenticated": Unauthenticated,
    "permission_denied": PermissionDenied,
    "not_found": NotFound,
    "already_exists": AlreadyExists,
    "failed_precondition": FailedPrecondition,
    "quota_exceeded": QuotaExceeded,
    "resource_exhausted": CapacityExhausted,
    "unavailable": Unavailable,
    "internal": InternalError,
}

# A sandbox-scoped path: /v1/sandboxes/{id} and everything below it. The
# collection verbs (/v1/sandboxes:batch, ...) do not match.
_SANDBOX_PATH = re.compile(r"^/v1/sandboxes/([^/?:]+)(/[^?]*)?")


def error_from_code(
    code: str,
    message: str,
    *,
    status: int = 0,
    method: Optional[str] = None,
    path: Optional[str] = None,
) -> DSecError:
    """Build the exception for an API error code.

    A ``not_found`` on a sandbox-scoped path becomes :class:`SandboxNotFound`
    when it is the sandbox that is missing: the call was on the sandbox
    itself (``/v1/sandboxes/{id}``), or the server's message names it
    (``"sandbox <id> not found"``). A missing file or session under an
    existing sandbox stays a plain :class:`NotFound`. Unknown codes give a
    plain :class:`DSecError` that keeps the code.
    """
    cls = _BY_CODE.get(code, DSecError)
    if cls is NotFound and path:
        m = _SANDBOX_PATH.match(path.split("?", 1)[0])
        if m and (not m.group(2) or message.startswith("sandbox ")):
            cls = SandboxNotFound
    return cls(message, code=code, status=status, method=method, path=path)


def _code_for_status(status: int) -> str:
    # 409 stays unclassified: it is either already_exists or
    # failed_precondition, and guessing would mislead.
    return {
        400: "invalid_argument",
        401: "unauthenticated",
        403: "permission_denied",
        404: "not_found",
        429: "quota_exceeded",
        500: "internal",
        502: "unavailable",
        503: "unavailable",
        504: "unavailable",
    }.get(status, "")


def error_from_response(
    status: int,
    body: bytes,
    *,
    method: Optional[str] = None,
    path: Optional[str] = None,
) -> DSecError:
    """Build the exception for a non-2xx answer.

    The body is normally the API's ``{"error": {"code", "message"}}``; a body
    that is not (a proxy's HTML page, a panic trace) still yields the status,
    the start of the body and a code guessed from the status.
    """
    try:
        doc = json.loads(body.decode("utf-8"))
        err = doc.get("error") if isinstance(doc, dict) else None
    except (ValueError, UnicodeDecodeError):
        err = None
    if isinstance(err, dict) and (err.get("code") or err.get("message")):
        code = str(err.get("code") or _code_for_status(status))
        return error_from_code(code, str(err.get("message") or ""), status=status, method=method, path=path)
    text = body[:200].decode("utf-8", errors="replace").strip()
    if len(body) > 200:
        text += "..."
    msg = f"HTTP {status}" + (f": {text}" if text else "")
    return error_from_code(_code_for_status(status), msg, status=status, method=method, path=path)
