"""A WebSocket client (RFC 6455) on a connection the HTTP layer upgraded.

Only what the terminal needs. No extension (compression) and no
subprotocol is offered, so a server choosing one fails the handshake.
Frames are parsed from a buffer that reads fill, with no await between a
frame's first byte and its last: a read cancelled by a timeout loses
nothing, and the next one goes on where it stopped. Every frame the client
sends is masked with a fresh random key, as the RFC requires of clients;
frames and messages from the server are bounded (``max_message``).

Pings are answered when the caller reads: a caller that stops reading
stops answering them, as it stops taking output.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import struct
from typing import Callable, Optional, Union

from .errors import ConnectionFailed, DSecError, ProtocolError

CONT, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
_OPCODES = frozenset({CONT, TEXT, BINARY, CLOSE, PING, PONG})
_CONTROL = frozenset({CLOSE, PING, PONG})

# Close codes (RFC 6455 §7.4.1).
NORMAL = 1000
GOING_AWAY = 1001
PROTOCOL_ERROR = 1002
NO_STATUS = 1005  # the close frame had no code; never sent
BAD_DATA = 1007
POLICY = 1008
TOO_BIG = 1009
INTERNAL = 1011

#: The largest frame, and the largest message, accepted from the server.
MAX_MESSAGE = 16 << 20

_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_READ_PIECE = 64 << 10
# A close frame's payload is at most 125 bytes: the code and 123 of reason.
_MAX_REASON = 123


def new_key() -> str:
    """A Sec-WebSocket-Key: 16 random bytes, base64."""
    return base64.b64encode(os.urandom(16)).decode()


def accept_for(key: str) -> str:
    """The Sec-WebSocket-Accept a server must answer to ``key``."""
    return base64.b64encode(hashlib.sha1((key + _GUID).encode()).digest()).decode()


def upgrade_headers(key: str) -> list[tuple[str, str]]:
    """The request headers asking for a WebSocket."""
    return [
        ("Upgrade", "websocket"),
        ("Connection", "Upgrade"),
        ("Sec-WebSocket-Key", key),
        ("Sec-WebSocket-Version", "13"),
    ]


def check_upgrade(headers: dict[str, str], key: str) -> None:
    """Raise ProtocolError unless the headers of a 101 answer (lower-case
    names) complete the handshake started with ``key``."""
    if headers.get("upgrade", "").strip().lower() != "websocket":
        raise ProtocolError(f"the server switched to {headers.get('upgrade', '')!r}, not to a WebSocket")
    if "upgrade" not in {t.strip().lower() for t in headers.get("connection", "").split(",")}:
        raise ProtocolError("the server's 101 answer lacks Connection: Upgrade")
    if headers.get("sec-websocket-accept", "").strip() != accept_for(key):
        raise ProtocolError("the server's Sec-WebSocket-Accept does not match the key sent")
    if headers.get("sec-websocket-extensions", "").strip():
        raise ProtocolError(f"the server chose WebSocket extensions the client did not offer: {headers['sec-websocket-extensions']}")
    if headers.get("sec-websocket-protocol", "").strip():
        raise ProtocolError(f"the server chose a subprotocol the client did not offer: {headers['sec-websocket-protocol']}")


Bytes = Union[bytes, bytearray, memoryview]


def mask(data: Bytes, key: bytes) -> bytes:
    """XOR ``data`` with the 4-byte ``key`` repeated (its own inverse)."""
    n = len(data)
    if n == 0:
        return b""
    k = (key * (n // 4 + 1))[:n]
    # One big-integer XOR: fast in CPython, and no per-byte loop.
    return (int.from_bytes(data, "little") ^ int.from_bytes(k, "little")).to_bytes(n, "little")


def encode_frame(opcode: int, payload: Bytes, *, fin: bool = True, key: Optional[bytes] = None) -> bytes:
    """One client frame, masked with ``key`` (default: a random one)."""
    if key is None:
        key = os.urandom(4)
    n = len(payload)
    b0 = (0x80 if fin else 0) | opcode
    if n < 126:
        head = struct.pack("!BB", b0, 0x80 | n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", b0, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", b0, 0x80 | 127, n)
    return head + key + mask(payload, key)


def close_payload(code: int, reason: str = "") -> bytes:
    """A close frame's payload; the reason is cut to fit, on a character
    boundary."""
    r = reason.encode()[:_MAX_REASON].decode("utf-8", "ignore").encode()
    return struct.pack("!H", code) + r


def _valid_close_code(code: int) -> bool:
    # 1004-1006 and 1015 are reserved: never sent in a frame.
    return (1000 <= code <= 1014 and code not in (1004, 1005, 1006)) or 3000 <= code <= 4999


class _Violation(Exception):
    """The server broke the protocol; the connection is failed with ``code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


Message = tuple[int, Union[bytes, str]]


class WebSocket:
    """The client end of a WebSocket over ``reader``/``writer``.

    ``on_done`` is called once, when the connection is given up (after the
    close handshake, or on an error); it must close the connection.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_done: Callable[[], None],
        *,
        max_message: int = MAX_MESSAGE,
    ) -> None:
        self._r = reader
        self._w = writer
        self._on_done = on_done
        self.max_message = max_message
        self._buf = bytearray()
        # A fragmented message being put together: its opcode and pieces.
        self._frag_op: Optional[int] = None
        self._frag: list[bytes] = []
        self._frag_len = 0
        self._rlock = asyncio.Lock()
        self._wlock = asyncio.Lock()
        self.close_sent = False
        self.close_received = False
        #: How the server closed: its code (NO_STATUS if it gave none) and reason.
        self.close_code: Optional[int] = None
        self.close_reason = ""
        self._done = False

    @property
    def done(self) -> bool:
        """The connection has been given up."""
        return self._done

    def abort(self) -> None:
        """Drop the connection without a close handshake."""
        if not self._done:
            self._done = True
            self._on_done()

    # -- sending ----------------------------------------------------------

    async def send(self, opcode: int, payload: Bytes) -> None:
        """Send one unfragmented TEXT or BINARY message."""
        if self.close_sent or self._done:
            raise ConnectionFailed("the WebSocket is closed")
        await self._write(encode_frame(opcode, payload))

    async def _write(self, frame: bytes) -> None:
        # write() queues the whole frame at once, so frames never interleave;
        # the lock only keeps drain() to one task at a time.
        async with self._wlock:
            try:
                self._w.write(frame)
                await self._w.drain()
            except (ConnectionError, OSError) as e:
                self.abort()
                raise ConnectionFailed(f"writing to the WebSocket: {e}") from None

    # -- receiving --------------------------------------------------------

    async def recv(self) -> Optional[Message]:
        """The next message, as ``(TEXT, str)`` or ``(BINARY, bytes)``; None
        once the connection is closed (``close_code`` and ``close_reason``
        then say how the server closed it, if it did). Pings met on the way
        are answered. A server breaking the protocol gets a close frame with
        the code for it, and ProtocolError is raised."""
        async with self._rlock:
            try:
                while True:
                    if self.close_received:
                        return None
                    if self._done:
                        if self.close_sent:
                            return None  # we closed it
                        raise ConnectionFailed("the WebSocket connection is closed")
                    frame = self._next_frame()
                    if frame is None:
                        await self._fill()
                        continue
                    fin, op, payload = frame
                    if op == PING:
                        if not self.close_sent:
                            await self._write(encode_frame(PONG, payload))
                    elif op == CLOSE:
                        await self._on_close(payload)
                        return None
                    elif op != PONG:
                        msg = self._assemble(fin, op, payload)
                        if msg is not None:
                            return msg
            except _Violation as v:
                await self._fail(v.code, str(v))
                raise ProtocolError(f"WebSocket: {v}") from None

    async def _fill(self) -> None:
        try:
            data = await self._r.read(_READ_PIECE)
        except (ConnectionError, OSError) as e:
            self.abort()
            raise ConnectionFailed(f"reading from the WebSocket: {e}") from None
        if not data:
            self.abort()
            if not self.close_sent:
                raise ConnectionFailed("the server dropped the connection without closing the WebSocket")
        self._buf += data

    def _next_frame(self) -> Optional[tuple[bool, int, bytes]]:
        """Take one whole frame off the buffer, or None if it is not all
        there yet. Sizes are checked as soon as the header is in."""
        b = self._buf
        if len(b) < 2:
            return None
        b0, b1 = b[0], b[1]
        fin, op = bool(b0 & 0x80), b0 & 0x0F
        if b0 & 0x70:
            raise _Violation(PROTOCOL_ERROR, "frame with reserved bits set (no extension was negotiated)")
        if op not in _OPCODES:
            raise _Violation(PROTOCOL_ERROR, f"unknown opcode {op:#x}")
        if b1 & 0x80:
            raise _Violation(PROTOCOL_ERROR, "masked frame from the server")
        n, pos = b1 & 0x7F, 2
        if n == 126:
            if len(b) < 4:
                return None
            n, pos = struct.unpack_from("!H", b, 2)[0], 4
        elif n == 127:
            if len(b) < 10:
                return None
            n, pos = struct.unpack_from("!Q", b, 2)[0], 10
        if op in _CONTROL and (n > 125 or not fin):
            raise _Violation(PROTOCOL_ERROR, "control frame fragmented or over 125 bytes")
        if n > self.max_message:
            raise _Violation(TOO_BIG, f"frame of {n} bytes, over the limit of {self.max_message}")
        if len(b) < pos + n:
            return None
        payload = bytes(b[pos : pos + n])
        del b[: pos + n]
        return fin, op, payload

    def _assemble(self, fin: bool, op: int, payload: bytes) -> Optional[Message]:
        """Fold a data frame into the message it belongs to; the message
        once it is complete."""
        if op == CONT:
            if self._frag_op is None:
                raise _Violation(PROTOCOL_ERROR, "continuation frame outside a fragmented message")
            self._frag_len += len(payload)
            if self._frag_len > self.max_message:
                raise _Violation(TOO_BIG, f"message over the limit of {self.max_message} bytes")
            self._frag.append(payload)
            if not fin:
                return None
            op, payload = self._frag_op, b"".join(self._frag)
            self._frag_op, self._frag, self._frag_len = None, [], 0
        elif self._frag_op is not None:
            raise _Violation(PROTOCOL_ERROR, "new message inside a fragmented one")
        elif not fin:
            self._frag_op, self._frag, self._frag_len = op, [payload], len(payload)
            return None
        if op == TEXT:
            try:
                return TEXT, payload.decode("utf-8")
            except UnicodeDecodeError:
                raise _Violation(BAD_DATA, "text message that is not UTF-8") from None
        return BINARY, payload

    async def _on_close(self, payload: bytes) -> None:
        code, reason = NO_STATUS, ""
        if len(payload) == 1:
            raise _Violation(PROTOCOL_ERROR, "close frame of one byte")
        if payload:
            code = struct.unpack_from("!H", payload)[0]
            if not _valid_close_code(code):
                raise _Violation(PROTOCOL_ERROR, f"close frame with code {code}")
            try:
                reason = payload[2:].decode("utf-8")
            except UnicodeDecodeError:
                raise _Violation(BAD_DATA, "close reason that is not UTF-8") from None
        self.close_received = True
        self.close_code, self.close_reason = code, reason
        try:
            if not self.close_sent:
                # Answer with the server's own code (RFC 6455 §5.5.1).
                self.close_sent = True
                await asyncio.wait_for(self._write(encode_frame(CLOSE, payload[:2])), 5.0)
        except (DSecError, asyncio.TimeoutError):
            pass  # the server stops waiting for it soon enough
        finally:
            self.abort()

    async def _fail(self, code: int, reason: str) -> None:
        try:
            if not self.close_sent and not self._done:
                self.close_sent = True
                await asyncio.wait_for(self._write(encode_frame(CLOSE, close_payload(code, reason))), 1.0)
        except (DSecError, asyncio.TimeoutError):
            pass
        finally:
            self.abort()

    # -- closing ----------------------------------------------------------

    async def close(self, code: int = NORMAL, reason: str = "", timeout: float = 5.0) -> None:
        """Close the WebSocket: send a close frame (unless the server's came
        first), wait up to ``timeout`` seconds for the server's, discarding
        what comes before it, then drop the connection."""
        if self._done:
            return

        async def handshake() -> None:
            if not self.close_sent:
                self.close_sent = True
                await self._write(encode_frame(CLOSE, close_payload(code, reason)))
            while await self.recv() is not None:
                pass  # output after our close: nobody wants it any more

        try:
            await asyncio.wait_for(handshake(), timeout)
        except (DSecError, asyncio.TimeoutError):
            pass  # the connection goes anyway
        finally:
            self.abort()
