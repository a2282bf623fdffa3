"""Unit tests of terminals (Sandbox.pty) against a WebSocket server written
here, independently of the client's own framing code: the handshake, masking,
fragments, pings, the exit message, both close handshakes, protocol
violations, and the API errors answered before the upgrade."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import socket
import struct
import traceback
import unittest
from typing import Awaitable, Callable, Optional

from fakeserver import AsyncTest, Reply, Request, _read_request, _write_reply, error_reply

import libdsec
import libdsec.sync

CONT, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Peer:
    """The server end of one WebSocket. Every frame the client sends must be
    masked; the keys are kept to check they change."""

    def __init__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, req: Request) -> None:
        self.r, self.w, self.req = r, w, req
        self.masks: list[bytes] = []

    async def frame(self) -> tuple[bool, int, bytes]:
        b0, b1 = await self.r.readexactly(2)
        if not b1 & 0x80:
            raise AssertionError(f"client frame (opcode {b0 & 0xF:#x}) is not masked")
        if b0 & 0x70:
            raise AssertionError("client frame has reserved bits set")
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack("!H", await self.r.readexactly(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", await self.r.readexactly(8))[0]
        key = await self.r.readexactly(4)
        self.masks.append(key)
        raw = await self.r.readexactly(n)
        return bool(b0 & 0x80), b0 & 0xF, bytes(b ^ key[i % 4] for i, b in enumerate(raw))

    async def message(self) -> tuple[int, bytes]:
        """The next client message other than a pong."""
        while True:
            fin, op, data = await self.frame()
            if not fin:
                raise AssertionError("the client fragmented a message")
            if op != PONG:
                return op, data

    def send(self, op: int, data: "bytes | str" = b"", *, fin: bool = True, rsv: int = 0, masked: bool = False, length: Optional[int] = None) -> None:
        if isinstance(data, str):
            data = data.encode()
        n = len(data) if length is None else length
        b0 = (0x80 if fin else 0) | rsv | op
        m = 0x80 if masked else 0
        if n < 126:
            head = bytes([b0, m | n])
        elif n < 1 << 16:
            head = struct.pack("!BBH", b0, m | 126, n)
        else:
            head = struct.pack("!BBQ", b0, m | 127, n)
        if masked:
            key = b"\x01\x02\x03\x04"
            head += key
            data = bytes(b ^ key[i % 4] for i, b in enumerate(data))
        self.w.write(head + data)

    async def flush(self) -> None:
        await self.w.drain()

    async def exit(self, code: int, status: str = "exited") -> int:
        """End the shell as the server does: the exit message, a normal
        close; returns the code of the client's answering close frame."""
        self.send(TEXT, json.dumps({"exit_code": code, "status": status}))
        self.send(CLOSE, struct.pack("!H", 1000))
        await self.flush()
        op, data = await self.message()
        if op != CLOSE:
            raise AssertionError(f"after the close, got opcode {op:#x} ({data[:50]!r}) instead of the client's close")
        return struct.unpack("!H", data[:2])[0] if data else 1005

    async def expect_close(self) -> tuple[int, str]:
        """Wait for the client's close (skipping data), answer it; its code
        and reason."""
        while True:
            op, data = await self.message()
            if op == CLOSE:
                self.send(CLOSE, data[:2])
                await self.flush()
                return struct.unpack("!H", data[:2])[0], data[2:].decode()


Session = Callable[[Peer], Awaitable[None]]


class WSServer:
    """Answers each connection's request with ``before(req)`` if that gives
    a Reply, else upgrades it and runs ``session`` on it. Failures inside
    the server fail the test when the block ends."""

    def __init__(
        self,
        session: Optional[Session] = None,
        *,
        before: Optional[Callable[[Request], Optional[Reply]]] = None,
        accept: Optional[Callable[[str], str]] = None,
        extra_head: str = "",
    ) -> None:
        self.session = session
        self.before = before
        self.accept = accept
        self.extra_head = extra_head
        self.requests: list[Request] = []
        self.peers: list[Peer] = []
        self.failures: list[str] = []
        self._tasks: set[asyncio.Task] = set()
        # Connections waiting for a request (kept alive by the client).
        self._idle: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> "WSServer":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        for w in self._idle:
            w.close()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=5)
            for t in pending:
                t.cancel()
                self.failures.append("a server session did not end")
        await self._server.wait_closed()
        if self.failures and exc[0] is None:
            raise AssertionError("server side:\n" + "\n".join(self.failures))

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        try:
            while True:
                self._idle.add(w)
                try:
                    req = await _read_request(r)
                finally:
                    self._idle.discard(w)
                if req is None:
                    return
                self.requests.append(req)
                reply = self.before(req) if self.before else None
                if reply is not None:
                    await _write_reply(w, reply)
                    continue
                h = req.headers
                assert h.get("upgrade", "").lower() == "websocket", h
                assert "upgrade" in h.get("connection", "").lower(), h
                assert h.get("sec-websocket-version") == "13", h
                key = h["sec-websocket-key"]
                assert len(base64.b64decode(key, validate=True)) == 16, key
                accept = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
                if self.accept:
                    accept = self.accept(accept)
                w.write(
                    (
                        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                        f"Sec-WebSocket-Accept: {accept}\r\n{self.extra_head}\r\n"
                    ).encode()
                )
                await w.drain()
                peer = Peer(r, w, req)
                self.peers.append(peer)
                if self.session is not None:
                    await self.session(peer)
                return
        except Exception:
            self.failures.append(traceback.format_exc())
        finally:
            w.close()


async def echo(p: Peer) -> None:
    """Echo binary messages until the client closes."""
    while True:
        op, data = await p.message()
        if op == CLOSE:
            p.send(CLOSE, data[:2])
            await p.flush()
            return
        if op == BINARY:
            p.send(BINARY, data)
            await p.flush()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class TerminalTest(AsyncTest):
    def client(self, srv: WSServer, **kw) -> libdsec.DSecClient:
        kw.setdefault("backoff_base", 0.001)
        c = libdsec.DSecClient(srv.endpoint, "k", **kw)
        self.addAsyncCleanup(c.close)
        return c

    async def test_handshake_masking_and_echo(self):
        async with WSServer(echo) as srv:
            c = self.client(srv)
            t = await c.sandbox("sb-e-1").pty(100, 30, cmd="top -b", user="u")
            self.assertEqual(c._pool.in_use, 1, "an open terminal holds a connection")
            await t.write(b"hello")
            self.assertEqual(await t.read(), b"hello")
            await t.write("h\u00e9llo \u2603")
            self.assertEqual(await t.read(), "h\u00e9llo \u2603".encode())
            await t.write(bytearray(b"x" * 300))  # 16-bit length
            self.assertEqual(await t.read(), b"x" * 300)
            await t.close()
            await t.close()  # idempotent
            self.assertEqual(await t.read(), b"", "a closed terminal reads as ended")
            self.assertIsNone(t.exit_code)
            with self.assertRaises(libdsec.ConnectionFailed):
                await t.write(b"late")
            self.assertEqual(c._pool.in_use, 0, "closing gives the connection back")
            t2 = await c.sandbox("sb-e-1").pty()
            await t2.close()
        r = srv.requests[0]
        self.assertEqual(r.path, "/v1/sandboxes/sb-e-1/pty")
        self.assertEqual(r.query, {"cols": ["100"], "rows": ["30"], "cmd": ["top -b"], "user": ["u"]})
        self.assertEqual(r.headers["authorization"], "Bearer k")
        self.assertEqual(srv.requests[1].query, {"cols": ["80"], "rows": ["24"]})
        self.assertNotEqual(r.headers["sec-websocket-key"], srv.requests[1].headers["sec-websocket-key"])
        masks = srv.peers[0].masks
        self.assertEqual(len(masks), 4, "three messages and the close, each masked")
        self.assertEqual(len(set(masks)), 4, "each frame has its own mask key")

    async def test_fragments_ping_and_exit(self):
        seen: dict = {}

        async def session(p: Peer) -> None:
            p.send(BINARY, b"ab", fin=False)
            p.send(PING, b"p1")  # control frames may come between fragments
            p.send(CONT, b"cd", fin=False)
            p.send(CONT, b"ef")
            p.send(TEXT, '{"exit_code": ', fin=False)
            p.send(CONT, '5, "status": "exited"}')
            p.send(CLOSE, struct.pack("!H", 1000))
            await p.flush()
            fin, op, data = await p.frame()
            seen["pong"] = (op, data)
            op, data = await p.message()
            seen["close"] = (op, data)

        async with WSServer(session) as srv:
            c = self.client(srv)
            t = await c.sandbox("sb-e-1").pty()
            self.assertEqual(await t.read(), b"abcdef")
            self.assertEqual(await t.read(), b"")
            self.assertEqual(await t.read(), b"")
            self.assertEqual((t.exit_code, t.status), (5, "exited"))
            self.assertEqual(await t.wait(), 5)
            self.assertEqual(c._pool.in_use, 0, "the server's close gives the connection back")
            await t.close()
        self.assertEqual(seen["pong"], (PONG, b"p1"))
        self.assertEqual(seen["close"], (CLOSE, struct.pack("!H", 1000)), "the client answers the close with its code")

    async def test_wait_and_iteration(self):
        big = bytes(range(256)) * 300  # 76800 bytes: a 64-bit length

        async def session(p: Peer) -> None:
            await p.message()  # the client's go
            p.send(BINARY, b"one ")
            p.send(BINARY, big)
            p.send(BINARY, b"")  # an empty message is not the end
            p.send(BINARY, b"two")
            code = await p.exit(0)
            assert code == 1000, code

        async with WSServer(session) as srv:
            c = self.client(srv)
            async with c.sandbox("sb-e-1").pty() as t:
                await t.write("go")
                out = b"".join([chunk async for chunk in t])
                self.assertEqual(out, b"one " + big + b"two")
                self.assertEqual(t.exit_code, 0)

        async with WSServer(session) as srv:
            c = self.client(srv)
            async with c.sandbox("sb-e-1").pty() as t:
                await t.write("go")
                self.assertEqual(await t.wait(), 0)

    async def test_resize_and_large_write(self):
        got: dict = {"input": b"", "pieces": 0}

        async def session(p: Peer) -> None:
            op, data = await p.message()
            got["resize"] = (op, json.loads(data))
            while len(got["input"]) < 200_000:
                op, data = await p.message()
                assert op == BINARY, op
                got["input"] += data
                got["pieces"] += 1
                got["largest"] = max(got.get("largest", 0), len(data))
            await p.exit(0)

        async with WSServer(session) as srv:
            c = self.client(srv)
            async with c.sandbox("sb-e-1").pty() as t:
                for cols, rows in ((0, 10), (10, 4097), (True, 5), ("80", 24)):
                    with self.assertRaises(libdsec.InvalidArgument):
                        await t.resize(cols, rows)
                await t.resize(132, 43)
                data = bytes(range(256)) * 800  # 204800 bytes
                await t.write(data)
                self.assertEqual(await t.wait(), 0)
        self.assertEqual(got["resize"], (TEXT, {"resize": {"cols": 132, "rows": 43}}))
        self.assertEqual(got["input"], data)
        self.assertLessEqual(got["largest"], 64 << 10, "input goes in pieces the server takes")
        self.assertEqual(got["pieces"], 4)

    async def test_client_close_kills_by_closing(self):
        got: dict = {}

        async def session(p: Peer) -> None:
            got["input"] = await p.message()
            got["close"] = await p.expect_close()

        async with WSServer(session) as srv:
            c = self.client(srv)
            async with c.sandbox("sb-e-1").pty() as t:
                await t.write("sleep 100\n")
            with self.assertRaises(libdsec.ConnectionFailed):
                await t.wait()
            self.assertEqual(c._pool.in_use, 0)
        self.assertEqual(got["input"], (BINARY, b"sleep 100\n"))
        self.assertEqual(got["close"], (1000, ""))

    async def test_close_while_another_task_reads(self):
        async def session(p: Peer) -> None:
            p.send(BINARY, b"prompt$ ")
            await p.flush()
            await p.expect_close()

        async with WSServer(session) as srv:
            c = self.client(srv)
            t = await c.sandbox("sb-e-1").pty()
            self.assertEqual(await t.read(), b"prompt$ ")
            reader = asyncio.create_task(t.read())
            await asyncio.sleep(0.05)
            await asyncio.wait_for(t.close(), 2)
            self.assertEqual(await asyncio.wait_for(reader, 2), b"")

    async def test_read_timeout_loses_nothing(self):
        async def session(p: Peer) -> None:
            # Half a frame, then the rest once the client has given up.
            p.w.write(b"\x82\x05he")
            await p.flush()
            op, data = await p.message()
            assert (op, data) == (BINARY, b"more"), (op, data)
            p.w.write(b"llo")
            await p.exit(0)

        async with WSServer(session) as srv:
            c = self.client(srv)
            async with c.sandbox("sb-e-1").pty() as t:
                with self.assertRaises(libdsec.DeadlineExceeded):
                    await t.read(timeout=0.1)
                with self.assertRaises(TimeoutError):
                    await t.wait(timeout=0.05)
                await t.write("more")
                self.assertEqual(await t.read(timeout=5), b"hello")
                self.assertEqual(await t.wait(timeout=5), 0)

    async def test_server_close_codes_become_errors(self):
        cases = [
            (1011, "unavailable: edge e is unreachable", libdsec.Unavailable),
            (1011, "not_found: sandbox sb-e-1 not found", libdsec.SandboxNotFound),
            (1011, "something broke", libdsec.InternalError),
            (1008, 'a text frame must be {"resize": ...}', libdsec.InvalidArgument),
            (4000, "", libdsec.ConnectionFailed),
        ]
        for code, reason, cls in cases:
            with self.subTest(code=code, reason=reason):

                async def session(p: Peer) -> None:
                    p.send(BINARY, b"partial output")
                    p.send(CLOSE, struct.pack("!H", code) + reason.encode())
                    await p.flush()
                    op, data = await p.message()
                    assert op == CLOSE and data == struct.pack("!H", code), (op, data)

                async with WSServer(session) as srv:
                    c = self.client(srv)
                    async with c.sandbox("sb-e-1").pty() as t:
                        self.assertEqual(await t.read(), b"partial output")
                        with self.assertRaises(cls) as cm:
                            await t.read()
                        with self.assertRaises(cls):
                            await t.wait()  # the error stays
                    if code == 1011 and ": " in reason:
                        self.assertEqual(cm.exception.message, reason.split(": ", 1)[1])
                    self.assertEqual(cm.exception.path, "/v1/sandboxes/sb-e-1/pty")

    async def test_dropped_connection(self):
        async def session(p: Peer) -> None:
            p.send(BINARY, b"bye")
            await p.flush()  # and hang up without a close frame

        async with WSServer(session) as srv:
            c = self.client(srv)
            t = await c.sandbox("sb-e-1").pty()
            self.assertEqual(await t.read(), b"bye")
            with self.assertRaises(libdsec.ConnectionFailed):
                await t.read()
            self.assertEqual(c._pool.in_use, 0)
            await t.close()

    async def test_protocol_violations(self):
        def big_header(p: Peer) -> None:
            p.send(BINARY, b"", length=(16 << 20) + 1)  # the header alone

        cases = [
            ("masked", lambda p: p.send(BINARY, b"x", masked=True), 1002),
            ("reserved bits", lambda p: p.send(BINARY, b"x", rsv=0x40), 1002),
            ("unknown opcode", lambda p: p.send(0x3, b"x"), 1002),
            ("stray continuation", lambda p: p.send(CONT, b"x"), 1002),
            ("message inside a message", lambda p: (p.send(BINARY, b"a", fin=False), p.send(BINARY, b"b")), 1002),
            ("fragmented ping", lambda p: p.send(PING, b"x", fin=False), 1002),
            ("long ping", lambda p: p.send(PING, b"x" * 126), 1002),
            ("text not UTF-8", lambda p: p.send(TEXT, b"\xff\xfe"), 1007),
            ("frame over 16 MiB", big_header, 1009),
        ]
        for name, bad, want in cases:
            with self.subTest(name):
                got: dict = {}

                async def session(p: Peer) -> None:
                    bad(p)
                    await p.flush()
                    op, data = await p.message()
                    got["close"] = (op, struct.unpack("!H", data[:2])[0])

                async with WSServer(session) as srv:
                    c = self.client(srv)
                    t = await c.sandbox("sb-e-1").pty()
                    with self.assertRaises(libdsec.ProtocolError):
                        await t.read()
                    self.assertEqual(c._pool.in_use, 0)
                self.assertEqual(got["close"], (CLOSE, want))

    async def test_message_over_the_limit_in_fragments(self):
        got: dict = {}

        async def session(p: Peer) -> None:
            piece = b"x" * (1 << 20)
            p.send(BINARY, piece, fin=False)
            for _ in range(16):
                p.send(CONT, piece, fin=False)
            await p.flush()
            op, data = await p.message()
            got["close"] = struct.unpack("!H", data[:2])[0]

        async with WSServer(session) as srv:
            c = self.client(srv)
            t = await c.sandbox("sb-e-1").pty()
            with self.assertRaises(libdsec.ProtocolError):
                await t.read()
        self.assertEqual(got["close"], 1009)

    async def test_errors_before_the_upgrade(self):
        cases = [
            (error_reply(404, "not_found", "sandbox sb-x not found"), libdsec.SandboxNotFound, 404),
            (error_reply(400, "invalid_argument", 'query parameter cols="0": want 1..4096'), libdsec.InvalidArgument, 400),
            (error_reply(401, "unauthenticated", "missing or unknown API key"), libdsec.Unauthenticated, 401),
            # A gateway's page: not dsec's answer, and not sent again (each
            # request that gets through starts a shell).
            (Reply(503, body=b"<html>bad gateway</html>"), libdsec.Unavailable, 503),
        ]
        for reply, cls, status in cases:
            with self.subTest(status=status):
                async with WSServer(before=lambda req: reply) as srv:
                    c = self.client(srv)
                    with self.assertRaises(cls) as cm:
                        await c.sandbox("sb-x").pty(cols=0)
                    self.assertEqual(cm.exception.status, status)
                    self.assertEqual(c._pool.in_use, 0)
                    self.assertEqual(len(srv.requests), 1, "opening a terminal is not retried once sent")
        self.assertEqual(srv.requests[0].query["cols"], ["0"], "sizes are the server's to refuse")

    async def test_bad_handshakes(self):
        cases = [
            ("wrong accept", dict(accept=lambda a: base64.b64encode(b"x" * 20).decode())),
            ("extension", dict(extra_head="Sec-WebSocket-Extensions: permessage-deflate\r\n")),
            ("subprotocol", dict(extra_head="Sec-WebSocket-Protocol: chat\r\n")),
            ("200 instead of 101", dict(before=lambda req: Reply(200, body=b"{}"))),
        ]
        for name, kw in cases:
            with self.subTest(name):
                async with WSServer(None, **kw) as srv:
                    c = self.client(srv)
                    with self.assertRaises(libdsec.ProtocolError):
                        await c.sandbox("sb-e-1").pty()
                    self.assertEqual(c._pool.in_use, 0)

    async def test_arguments(self):
        async with WSServer(echo) as srv:
            c = self.client(srv)
            with self.assertRaises(libdsec.InvalidArgument):
                c.sandbox("sb-e-1").pty(cmd="ls", shell="/bin/bash")
            async with c.sandbox("sb-e-1").pty(shell="/bin/zsh") as t:
                await t.write("x")
                self.assertEqual(await t.read(), b"x")
            with self.assertRaises(TypeError):
                await t.write(123)  # type: ignore[arg-type]
        self.assertEqual(srv.requests[0].query["shell"], ["/bin/zsh"])
        self.assertNotIn("cmd", srv.requests[0].query)

    async def test_failover_to_the_next_endpoint(self):
        async with WSServer(echo) as srv:
            c = libdsec.DSecClient(f"http://127.0.0.1:{closed_port()},{srv.endpoint}", "k", backoff_base=0.001)
            self.addAsyncCleanup(c.close)
            async with c.sandbox("sb-e-1").pty() as t:
                await t.write("hi")
                self.assertEqual(await t.read(), b"hi")
            self.assertEqual(c.endpoint, srv.endpoint, "the client stays with the endpoint that answered")

    async def test_sync_facade(self):
        got: dict = {}

        async def session(p: Peer) -> None:
            op, data = await p.message()
            p.send(BINARY, data)
            await p.flush()
            got["resize"] = json.loads((await p.message())[1])
            p.send(BINARY, b"bye")
            await p.exit(3)

        def run(endpoint: str) -> tuple:
            with libdsec.sync.DSecClient(endpoint, "k") as c:
                with c.sandbox("sb-e-1").pty(cols=90, rows=20) as t:
                    t.write("hi")
                    first = t.read(timeout=5)
                    t.resize(10, 11)
                    rest = b"".join(t)
                    return first, rest, t.exit_code, t.status, t.wait()

        async with WSServer(session, before=lambda req: Reply(200, body=b'{"status":"ok"}') if req.path == "/healthz" else None) as srv:
            first, rest, code, status, waited = await asyncio.to_thread(run, srv.endpoint)
        self.assertEqual((first, rest, code, status, waited), (b"hi", b"bye", 3, "exited", 3))
        self.assertEqual(got["resize"], {"resize": {"cols": 10, "rows": 11}})
        self.assertEqual(srv.requests[-1].query, {"cols": ["90"], "rows": ["20"]})


class FramingTest(unittest.TestCase):
    def test_mask_is_its_own_inverse(self):
        from libdsec import _ws

        key = b"\x9a\x01\xff\x10"
        for n in (0, 1, 3, 4, 5, 125, 126, 65536, 70001):
            data = bytes(i * 7 % 256 for i in range(n))
            want = bytes(b ^ key[i % 4] for i, b in enumerate(data))
            self.assertEqual(_ws.mask(data, key), want, n)
            self.assertEqual(_ws.mask(_ws.mask(data, key), key), data)

    def test_accept_of_the_rfc_example(self):
        from libdsec import _ws

        # RFC 6455 §1.3.
        self.assertEqual(_ws.accept_for("dGhlIHNhbXBsZSBub25jZQ=="), "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")

    def test_close_reason_is_cut_on_a_character(self):
        from libdsec import _ws

        p = _ws.close_payload(1000, "\u00e9" * 100)
        self.assertLessEqual(len(p), 125)
        p[2:].decode("utf-8")


if __name__ == "__main__":
    unittest.main()
