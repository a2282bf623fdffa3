"""A small HTTP/1.1 client on asyncio streams, with a bounded keep-alive pool.

Why not urllib or http.client: they block, so driving hundreds of concurrent
sandbox calls would need a thread per call. Here every call is a coroutine;
a semaphore bounds the connections open to the endpoint, and calls beyond
the bound wait for a connection to come back to the pool. An in-flight call
holds its connection for its whole duration (HTTP/1.1 has no multiplexing),
so a long exec occupies one connection until the command ends.

Only what the dsec API needs is implemented: requests with a Content-Length
body (bytes or a seekable binary file), responses framed by Content-Length,
chunked transfer encoding or connection close, streaming reads of the
response body, and handing a connection over to another protocol after a
101 Switching Protocols (the terminal's WebSocket, _ws.py). No redirects,
no compression, no proxies.
"""

from __future__ import annotations

import asyncio
import collections
import ssl as _ssl
from typing import AsyncIterator, BinaryIO, Optional, Union

from .errors import ConnectionFailed, ProtocolError

Body = Union[bytes, bytearray, memoryview, BinaryIO, None]

_WRITE_PIECE = 256 << 10
_READ_PIECE = 64 << 10


class ConnectError(ConnectionFailed):
    """The connection could not be opened: the request was never sent, so any
    call, idempotent or not, may be retried safely."""


class _Conn:
    __slots__ = ("reader", "writer", "idle_since", "reused")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0
        self.reused = False

    def usable(self) -> bool:
        # An idle connection the server closed has seen EOF (or data it
        # should not have sent); reusing it would fail the next request.
        # Bytes waiting on an idle connection are as bad: nothing was asked.
        return not self.writer.is_closing() and not self.reader.at_eof() and not getattr(self.reader, "_buffer", b"")

    def abort(self) -> None:
        try:
            self.writer.transport.abort()
        except Exception:  # loop already closed: nothing left to release
            pass


class Pool:
    """Keep-alive connections to one host, at most ``max_connections`` open.

    A pool belongs to one event loop at a time; it rebinds to a new loop
    when it is idle (e.g. between two ``asyncio.run`` calls).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        tls: bool = False,
        max_connections: int = 256,
        connect_timeout: float = 10.0,
        idle_timeout: float = 30.0,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.host = host
        self.port = port
        self.tls = tls
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.host_header = _host_header(host, port, tls)
        self._ssl_ctx: Optional[_ssl.SSLContext] = _ssl.create_default_context() if tls else None
        self._idle: collections.deque[_Conn] = collections.deque()
        self._sem: Optional[asyncio.Semaphore] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._in_use = 0
        self._closed = False
        #: Connections opened over the pool's life (for tests and metrics).
        self.opened_total = 0

    @property
    def in_use(self) -> int:
        """Connections currently lent to calls."""
        return self._in_use

    def _bind(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._in_use:
                raise RuntimeError("libdsec client used from two event loops at once; use one client per loop")
            for c in self._idle:
                c.abort()
            self._idle.clear()
            self._loop = loop
            self._sem = asyncio.Semaphore(self.max_connections)
        assert self._sem is not None
        return self._sem

    async def acquire(self) -> _Conn:
        """Lend a connection: an idle one if it is still good, else a new one."""
        if self._closed:
            raise ConnectError("client is closed")
        sem = self._bind()
        await sem.acquire()
        self._in_use += 1
        try:
            now = asyncio.get_running_loop().time()
            while self._idle:
                c = self._idle.pop()
                if c.usable() and now - c.idle_since < self.idle_timeout:
                    c.reused = True
                    return c
                c.abort()
            return await self._open()
        except BaseException:
            self._in_use -= 1
            sem.release()
            raise

    async def _open(self) -> _Conn:
        try:
            r, w = await asyncio.wait_for(
                asyncio.open_connection(
                    self.host,
                    self.port,
                    ssl=self._ssl_ctx,
                    server_hostname=self.host if self.tls else None,
                ),
                self.connect_timeout,
            )
        except asyncio.TimeoutError:
            raise ConnectError(f"connecting to {self.host_header}: timed out after {self.connect_timeout:g}s") from None
        except OSError as e:
            raise ConnectError(f"connecting to {self.host_header}: {e.strerror or e}") from None
        self.opened_total += 1
        return _Conn(r, w)

    def release(self, conn: _Conn, reusable: bool) -> None:
        """Take a connection back; one that is not reusable is closed."""
        if reusable and not self._closed and conn.usable() and self._loop is not None:
            conn.idle_since = self._loop.time()
            self._idle.append(conn)
        else:
            conn.abort()
        self._in_use -= 1
        if self._sem is not None:
            self._sem.release()

    async def close(self) -> None:
        """Close idle connections and refuse new calls. Calls in flight
        finish, and their connections are closed when they come back."""
        self._closed = True
        idle = list(self._idle)
        self._idle.clear()
        for c in idle:
            try:
                c.writer.close()
            except Exception:
                pass
        for c in idle:
            try:
                await asyncio.wait_for(c.writer.wait_closed(), 1.0)
            except Exception:  # already gone, or the peer is slow: fine
                pass

    async def send(self, method: str, target: str, headers: list[tuple[str, str]], body: Body = None) -> "Response":
        """Send one request and read the answer's head.

        The caller owns the returned Response and must read it to the end
        (which returns the connection) or close it.
        """
        conn = await self.acquire()
        try:
            await _write_request(conn, method, target, self.host_header, headers, body)
            resp = await _read_head(conn, method)
        except BaseException:
            self.release(conn, reusable=False)
            raise
        resp._attach(self, conn)
        return resp


def _host_header(host: str, port: int, tls: bool) -> str:
    h = f"[{host}]" if ":" in host else host
    if (tls and port == 443) or (not tls and port == 80):
        return h
    return f"{h}:{port}"


def _body_length(body: Body) -> int:
    if body is None:
        return 0
    if isinstance(body, (bytes, bytearray, memoryview)):
        return len(body)
    pos = body.tell()
    end = body.seek(0, 2)
    body.seek(pos)
    return end - pos


async def _write_request(
    conn: _Conn, method: str, target: str, host: str, headers: list[tuple[str, str]], body: Body
) -> None:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    for k, v in headers:
        if "\r" in v or "\n" in v or "\r" in k or "\n" in k:
            raise ValueError(f"header {k!r} contains a line break")
        lines.append(f"{k}: {v}")
    if body is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {_body_length(body)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    w = conn.writer
    try:
        if body is None:
            w.write(head)
        elif isinstance(body, (bytes, bytearray, memoryview)):
            if len(body) < _WRITE_PIECE:
                w.write(head + bytes(body))  # one segment for small requests
            else:
                w.write(head)
                w.write(body)
        else:
            w.write(head)
            while True:
                piece = body.read(_WRITE_PIECE)
                if not piece:
                    break
                w.write(piece)
                await w.drain()
        await w.drain()
    except (ConnectionError, OSError) as e:
        raise ConnectionFailed(f"sending {method} request: {e}") from None


async def _read_head(conn: _Conn, method: str) -> "Response":
    r = conn.reader
    while True:
        try:
            raw = await r.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            what = "closed the connection without answering" if not e.partial else "closed the connection in the answer's header"
            raise ConnectionFailed(f"server {what}") from None
        except asyncio.LimitOverrunError:
            raise ProtocolError("answer header too large") from None
        except (ConnectionError, OSError) as e:
            raise ConnectionFailed(f"reading answer: {e}") from None
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"bad status line {lines[0][:100]!r}")
        version, status = parts[0], int(parts[1])
        reason = parts[2] if len(parts) > 2 else ""
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            k, sep, v = line.partition(":")
            if not sep:
                raise ProtocolError(f"bad header line {line[:100]!r}")
            k = k.strip().lower()
            v = v.strip()
            headers[k] = f"{headers[k]}, {v}" if k in headers else v
        if 100 <= status < 200 and status != 101:
            continue  # 100 Continue and friends: the real answer follows
        break
    conn_tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep_alive = ("close" not in conn_tokens) if version == "HTTP/1.1" else ("keep-alive" in conn_tokens)
    if status == 101:
        keep_alive = False  # the connection now speaks another protocol
    te = headers.get("transfer-encoding", "").lower()
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        body = _BodyReader(r, "none", 0)
    elif te:
        if te.split(",")[-1].strip() != "chunked":
            raise ProtocolError(f"unsupported transfer-encoding {te!r}")
        body = _BodyReader(r, "chunked", 0)
    elif "content-length" in headers:
        try:
            n = int(headers["content-length"].split(",")[0])
            if n < 0:
                raise ValueError
        except ValueError:
            raise ProtocolError(f"bad content-length {headers['content-length']!r}") from None
        body = _BodyReader(r, "length", n)
    else:
        body = _BodyReader(r, "eof", 0)
        keep_alive = False
    return Response(status, reason, headers, body, keep_alive)


class _BodyReader:
    """Reads one response body in its framing; read() returns b"" at its end."""

    __slots__ = ("_r", "_mode", "_left", "_crlf", "done")

    def __init__(self, r: asyncio.StreamReader, mode: str, length: int) -> None:
        self._r = r
        self._mode = mode
        self._left = length
        self._crlf = False
        self.done = mode == "none" or (mode == "length" and length == 0)

    async def read(self, n: int = _READ_PIECE) -> bytes:
        if self.done:
            return b""
        try:
            if self._mode == "length":
                data = await self._r.read(min(n, self._left))
                if not data:
                    raise ConnectionFailed(f"connection closed with {self._left} bytes of the answer missing")
                self._left -= len(data)
                self.done = self._left == 0
                return data
            if self._mode == "eof":
                data = await self._r.read(n)
                if not data:
                    self.done = True
                return data
            return await self._read_chunked(n)
        except asyncio.IncompleteReadError:
            raise ConnectionFailed("connection closed in the middle of the answer") from None
        except asyncio.LimitOverrunError:
            raise ProtocolError("bad chunked encoding: line too long") from None
        except (ConnectionError, OSError) as e:
            raise ConnectionFailed(f"reading answer: {e}") from None

    async def _read_chunked(self, n: int) -> bytes:
        if self._left == 0:
            if self._crlf:
                if await self._r.readexactly(2) != b"\r\n":
                    raise ProtocolError("bad chunked encoding: missing CRLF after chunk")
                self._crlf = False
            line = await self._r.readuntil(b"\r\n")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size line {line[:40]!r}") from None
            if size < 0:
                raise ProtocolError("bad chunk size")
            if size == 0:
                while await self._r.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailers: none of interest
                self.done = True
                return b""
            self._left = size
        data = await self._r.read(min(n, self._left))
        if not data:
            raise ConnectionFailed("connection closed in the middle of a chunk")
        self._left -= len(data)
        if self._left == 0:
            self._crlf = True
        return data


class Response:
    """An answer whose body has not been read yet.

    Read it with :meth:`read`, :meth:`iter_bytes` or :meth:`iter_lines`;
    reading to the end returns the connection to the pool. :meth:`close`
    drops the connection instead (e.g. to stop a stream early). A Response
    dropped unread closes its connection when it is garbage collected.
    """

    def __init__(self, status: int, reason: str, headers: dict[str, str], body: _BodyReader, keep_alive: bool) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self._body = body
        self._keep_alive = keep_alive
        self._pool: Optional[Pool] = None
        self._conn: Optional[_Conn] = None

    def _attach(self, pool: Pool, conn: _Conn) -> None:
        self._pool, self._conn = pool, conn
        if self._body.done and self.status != 101:
            self._finish()

    def detach(self) -> "tuple[Pool, _Conn]":
        """Take over the connection of a 101 Switching Protocols answer.

        The caller then owns it and gives it back with
        ``pool.release(conn, reusable=False)`` when done, which closes it
        and frees its place in the pool.
        """
        if self.status != 101 or self._conn is None or self._pool is None:
            raise RuntimeError("only the connection of a 101 answer can be taken over")
        pool, conn = self._pool, self._conn
        self._pool, self._conn = None, None
        return pool, conn

    @property
    def reused_connection(self) -> bool:
        """The answer came over a connection an earlier call had used."""
        return bool(self._conn and self._conn.reused)

    def _finish(self) -> None:
        if self._conn is not None and self._pool is not None:
            conn, self._conn = self._conn, None
            self._pool.release(conn, reusable=self._keep_alive and self._body.done)

    def close(self) -> None:
        """Drop the connection (unless the body was read to its end, in which
        case it already went back to the pool)."""
        if self._conn is not None and self._pool is not None:
            conn, self._conn = self._conn, None
            self._pool.release(conn, reusable=False)

    async def read_some(self, n: int = _READ_PIECE) -> bytes:
        """Read the next piece of the body (b"" at its end)."""
        try:
            data = await self._body.read(n)
        except BaseException:
            self.close()
            raise
        if self._body.done:
            self._finish()
        return data

    async def read(self, limit: Optional[int] = None) -> bytes:
        """Read the whole body; ProtocolError past ``limit`` bytes."""
        parts: list[bytes] = []
        total = 0
        while True:
            data = await self.read_some()
            if not data:
                return b"".join(parts)
            total += len(data)
            if limit is not None and total > limit:
                self.close()
                raise ProtocolError(f"answer larger than {limit} bytes")
            parts.append(data)

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """Yield the body piece by piece as it arrives."""
        while True:
            data = await self.read_some()
            if not data:
                return
            yield data

    async def iter_lines(self, max_line: int = 256 << 20) -> AsyncIterator[bytes]:
        """Yield the body line by line (without the newline); a last line
        without a newline is yielded too."""
        buf = bytearray()
        while True:
            data = await self.read_some()
            if not data:
                if buf:
                    yield bytes(buf)
                return
            buf += data
            start = 0
            while True:
                i = buf.find(b"\n", start)
                if i < 0:
                    break
                yield bytes(buf[start:i])
                start = i + 1
            del buf[:start]
            if len(buf) > max_line:
                self.close()
                raise ProtocolError(f"line longer than {max_line} bytes")

    def __del__(self) -> None:
        if self._conn is not None:
            try:
                self.close()
            except Exception:
                pass
