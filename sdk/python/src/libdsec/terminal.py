"""Terminal: an interactive shell in a sandbox, under a pseudo-terminal.

``GET /v1/sandboxes/{id}/pty`` upgrades to a WebSocket (see _ws.py).
Binary messages carry the terminal's bytes both ways; the client resizes
with a text message ``{"resize": {"cols", "rows"}}``; when the shell ends
the server sends ``{"exit_code", "status"}`` and closes normally. Closing
the socket kills the shell's process tree. Errors before the upgrade (no
such sandbox, a bad size) are ordinary API errors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Generator, Optional, Union

from . import _ws
from .errors import (
    ConnectionFailed,
    DeadlineExceeded,
    DSecError,
    InternalError,
    InvalidArgument,
    ProtocolError,
    error_from_code,
)

if TYPE_CHECKING:
    from .sandbox import Sandbox

__all__ = ["Terminal", "TerminalStart"]

log = logging.getLogger("libdsec")

# Input goes in messages of at most this size: the server takes messages
# of up to 1 MiB.
_WRITE_PIECE = 64 << 10

# Terminal sizes the server accepts.
_MAX_SIZE = 4096

# The server's close reason for its own errors reads "<api code>: <message>".
_REASON = re.compile(r"^([a-z][a-z_]*): (.*)$", re.S)


def _check_size(cols: Any, rows: Any) -> None:
    for name, v in (("cols", cols), ("rows", rows)):
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= _MAX_SIZE:
            raise InvalidArgument(f"{name} must be an integer from 1 to {_MAX_SIZE}, got {v!r}")


class Terminal:
    """An interactive shell in a sandbox (see :meth:`Sandbox.pty`).

    ``read`` gives what the terminal shows, ``write`` types into it. Once
    the shell has ended, ``read`` returns ``b""`` and :attr:`exit_code`
    says how it ended. ``async with`` closes it at the end of the block;
    closing before the shell ends kills the shell and everything it
    started. A terminal holds one of the client's connections while open.

    One task may read while others write or resize. ``read`` is safe to
    cancel (``asyncio.wait_for``, or its ``timeout``): nothing is lost,
    and the next read goes on from there.
    """

    def __init__(self, sandbox_id: str, path: str, ws: _ws.WebSocket) -> None:
        #: The sandbox the shell runs in.
        self.sandbox_id = sandbox_id
        self._path = path
        self._ws = ws
        #: The shell's exit code once it has ended (None before, or when the
        #: terminal was closed first).
        self.exit_code: Optional[int] = None
        #: How the shell ended, as the server put it (e.g. ``"exited"``).
        self.status: Optional[str] = None
        self._ended = False
        self._error: Optional[DSecError] = None
        self._closed = False

    def __repr__(self) -> str:
        return f"Terminal(sandbox={self.sandbox_id!r}, exit_code={self.exit_code!r})"

    async def read(self, timeout: Optional[float] = None) -> bytes:
        """The next piece of output; ``b""`` once the shell has ended (or
        the terminal was closed). With ``timeout``, DeadlineExceeded if
        nothing comes within that many seconds; the terminal stays usable.
        A terminal the server ended abnormally raises the error it gave."""
        if timeout is None:
            return await self._read()
        try:
            return await asyncio.wait_for(self._read(), timeout)
        except asyncio.TimeoutError as e:
            if isinstance(e, DSecError):
                raise
            raise DeadlineExceeded(f"terminal in {self.sandbox_id}: no output within {timeout:g}s") from None

    async def _read(self) -> bytes:
        while True:
            if self._error is not None:
                raise self._error
            if self._ended:
                return b""
            try:
                msg = await self._ws.recv()
            except DSecError as e:
                self._ended, self._error = True, e
                raise
            if msg is None:
                self._ended = True
                self._error = self._close_error()
                continue
            op, data = msg
            if op == _ws.BINARY:
                if data:
                    return data  # type: ignore[return-value]
                continue
            self._on_text(str(data))

    def _on_text(self, text: str) -> None:
        try:
            doc = json.loads(text)
        except ValueError:
            log.debug("terminal in %s: ignoring a text message that is not JSON: %.100r", self.sandbox_id, text)
            return
        if isinstance(doc, dict) and "exit_code" in doc:
            try:
                self.exit_code = int(doc["exit_code"])
            except (TypeError, ValueError):
                raise ProtocolError(f"terminal in {self.sandbox_id}: bad exit message {text[:100]!r}") from None
            self.status = str(doc.get("status") or "")
        # Other messages are for a newer client: ignored.

    def _close_error(self) -> Optional[DSecError]:
        """The error a server's close stands for; None for a normal end."""
        code, reason = self._ws.close_code, self._ws.close_reason
        if self._closed or self.exit_code is not None:
            return None
        if code in (None, _ws.NORMAL, _ws.GOING_AWAY, _ws.NO_STATUS):
            return None
        if code == _ws.POLICY:
            return InvalidArgument(reason or "the server refused a message of the terminal", path=self._path)
        m = _REASON.match(reason)
        if m:
            return error_from_code(m.group(1), m.group(2), path=self._path)
        what = f"the server closed the terminal in {self.sandbox_id} (WebSocket code {code})" + (f": {reason}" if reason else "")
        if code == _ws.INTERNAL:
            return InternalError(what, path=self._path)
        if code in (_ws.PROTOCOL_ERROR, _ws.BAD_DATA, _ws.TOO_BIG):
            return ProtocolError(what, path=self._path)
        return ConnectionFailed(what, path=self._path)

    def __aiter__(self) -> "Terminal":
        return self

    async def __anext__(self) -> bytes:
        data = await self._read()
        if not data:
            raise StopAsyncIteration
        return data

    async def write(self, data: Union[bytes, bytearray, memoryview, str]) -> None:
        """Type ``data`` into the terminal (a str is sent UTF-8). ``"\\x03"``
        is ^C, ``"\\x04"`` ^D, as on a keyboard."""
        if isinstance(data, str):
            data = data.encode()
        elif not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"write takes bytes or str, not {type(data).__name__}")
        self._check_open()
        view = memoryview(data).cast("B")
        for i in range(0, len(view), _WRITE_PIECE):
            await self._ws.send(_ws.BINARY, view[i : i + _WRITE_PIECE])

    async def resize(self, cols: int, rows: int) -> None:
        """Set the terminal's size (1 to 4096 each); the shell gets SIGWINCH."""
        _check_size(cols, rows)
        self._check_open()
        await self._ws.send(_ws.TEXT, json.dumps({"resize": {"cols": cols, "rows": rows}}).encode())

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionFailed(f"the terminal in {self.sandbox_id} is closed")
        if self._ws.done or self._ws.close_sent:
            raise ConnectionFailed(f"the terminal in {self.sandbox_id} has ended")

    async def wait(self, timeout: Optional[float] = None) -> int:
        """Read (and discard) the output until the shell ends; its exit
        code. With ``timeout``, DeadlineExceeded if it has not ended by
        then (the terminal stays usable)."""

        async def drain() -> None:
            while await self._read():
                pass

        if timeout is None:
            await drain()
        else:
            try:
                await asyncio.wait_for(drain(), timeout)
            except asyncio.TimeoutError as e:
                if isinstance(e, DSecError):
                    raise
                raise DeadlineExceeded(f"terminal in {self.sandbox_id}: the shell did not end within {timeout:g}s") from None
        if self.exit_code is None:
            if self._closed:
                raise ConnectionFailed(f"the terminal in {self.sandbox_id} was closed before the shell ended")
            raise ProtocolError(f"the terminal in {self.sandbox_id} ended without the shell's exit status")
        return self.exit_code

    async def close(self) -> None:
        """Close the terminal; a shell still running is killed with
        everything it started. Idempotent."""
        self._closed = True
        await self._ws.close()

    async def __aenter__(self) -> "Terminal":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __del__(self) -> None:
        ws = getattr(self, "_ws", None)
        if ws is not None and not ws.done:
            try:
                ws.abort()  # the server kills the shell when the socket goes
            except Exception:
                pass


class TerminalStart:
    """What :meth:`Sandbox.pty` returns: await it for a :class:`Terminal`,
    or use it as ``async with`` to have the terminal closed at the end."""

    def __init__(self, start: Callable[[], Awaitable[Terminal]]) -> None:
        self._start = start
        self._term: Optional[Terminal] = None

    def __await__(self) -> Generator[Any, None, Terminal]:
        return self._start().__await__()  # type: ignore[attr-defined]

    async def __aenter__(self) -> Terminal:
        self._term = await self._start()
        return self._term

    async def __aexit__(self, *exc: Any) -> None:
        if self._term is not None:
            await self._term.close()


def open_terminal(
    sandbox: "Sandbox",
    cols: int,
    rows: int,
    cmd: Optional[str],
    shell: Optional[str],
    user: Optional[str],
    timeout: Optional[float],
) -> TerminalStart:
    """See :meth:`Sandbox.pty`."""
    if cmd and shell:
        raise InvalidArgument("give cmd or shell, not both")
    # The sizes are the server's to check (400 before the upgrade).
    query = [("cols", str(int(cols))), ("rows", str(int(rows)))]
    for name, v in (("cmd", cmd), ("shell", shell), ("user", user)):
        if v:
            query.append((name, v))

    async def start() -> Terminal:
        c = sandbox._client
        path = sandbox._path("/pty")
        key = _ws.new_key()
        # Not idempotent: each request that reaches the server starts a
        # shell. Like opening a session, it is sent again only when the
        # connection could not be opened (then to the next endpoint).
        resp = await c._send(
            "GET",
            path,
            query=query,
            deadline=c._deadline(timeout, f"pty in {sandbox.id}"),
            accept="*/*",
            idempotent=False,
            extra_headers=_ws.upgrade_headers(key),
            upgrade=True,
        )
        try:
            if resp.status != 101:
                raise ProtocolError(f"GET {path}: the server answered {resp.status} instead of switching to a WebSocket")
            _ws.check_upgrade(resp.headers, key)
        except BaseException:
            resp.close()
            raise
        pool, conn = resp.detach()
        ws = _ws.WebSocket(conn.reader, conn.writer, lambda: pool.release(conn, reusable=False))
        return Terminal(sandbox.id, path, ws)

    return TerminalStart(start)
