"""An in-process HTTP/1.1 server for the unit tests.

It speaks just enough HTTP (keep-alive, Content-Length and chunked bodies
both ways) to stand in for the dsec API, and counts connections so tests can
check the client's pooling. Tests give it an async handler that maps a
Request to a Reply.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import unittest
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Union
from urllib.parse import parse_qs, urlsplit

# Tests import libdsec from the source tree, installed or not.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


class AsyncTest(unittest.IsolatedAsyncioTestCase):
    """IsolatedAsyncioTestCase runs its loop in debug mode, which reports
    every step over 0.1 s; starting 512 tasks at once is such a step."""

    async def asyncSetUp(self) -> None:
        asyncio.get_running_loop().slow_callback_duration = 5.0


@dataclass
class Request:
    method: str
    target: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Reply:
    status: int = 200
    body: Union[bytes, str, dict, list, None] = None
    headers: dict[str, str] = field(default_factory=dict)
    # Send the body in these pieces with chunked transfer encoding.
    chunks: Optional[list[bytes]] = None
    chunk_delay: float = 0.0
    # Send the body without a length and close the connection after it.
    close_delimited: bool = False
    close: bool = False


#: A handler result that closes the connection without answering.
HANG_UP = object()


def json_reply(status: int, doc: Any) -> Reply:
    return Reply(status=status, body=json.dumps(doc).encode(), headers={"Content-Type": "application/json"})


def error_reply(status: int, code: str, message: str) -> Reply:
    return json_reply(status, {"error": {"code": code, "message": message}})


Handler = Callable[[Request], Awaitable[Any]]


class FakeServer:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[Request] = []
        self.open_now = 0
        self.max_open = 0
        self.accepted = 0
        self._server: Optional[asyncio.base_events.Server] = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> "FakeServer":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open_now += 1
        self.max_open = max(self.max_open, self.open_now)
        self._writers.add(writer)
        try:
            while True:
                req = await _read_request(reader)
                if req is None:
                    return
                self.requests.append(req)
                reply = await self.handler(req)
                if reply is HANG_UP:
                    return
                await _write_reply(writer, reply)
                if reply.close or reply.close_delimited:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            return  # client gone, or the test's loop shutting down
        finally:
            self.open_now -= 1
            self._writers.discard(writer)
            writer.close()


async def _read_request(r: asyncio.StreamReader) -> Optional[Request]:
    try:
        head = await r.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size = int((await r.readuntil(b"\r\n")).strip(), 16)
            if size == 0:
                await r.readuntil(b"\r\n")
                break
            body += await r.readexactly(size)
            await r.readexactly(2)
    else:
        body = await r.readexactly(int(headers.get("content-length", "0")))
    u = urlsplit(target)
    return Request(method, target, u.path, parse_qs(u.query, keep_blank_values=True), headers, body)


async def _write_reply(w: asyncio.StreamWriter, reply: Reply) -> None:
    body = reply.body
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
        reply.headers.setdefault("Content-Type", "application/json")
    elif isinstance(body, str):
        body = body.encode()
    elif body is None:
        body = b""
    reason = {200: "OK", 201: "Created", 204: "No Content"}.get(reply.status, "Status")
    head = [f"HTTP/1.1 {reply.status} {reason}"]
    head += [f"{k}: {v}" for k, v in reply.headers.items()]
    if reply.chunks is not None:
        head.append("Transfer-Encoding: chunked")
    elif reply.close_delimited:
        head.append("Connection: close")
    elif reply.status != 204:
        head.append(f"Content-Length: {len(body)}")
    if reply.close:
        head.append("Connection: close")
    w.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
    if reply.chunks is not None:
        for c in reply.chunks:
            if not c:
                continue
            w.write(f"{len(c):x};ext=1\r\n".encode() + c + b"\r\n")
            await w.drain()
            if reply.chunk_delay:
                await asyncio.sleep(reply.chunk_delay)
        w.write(b"0\r\nX-Trailer: t\r\n\r\n")
    else:
        w.write(body)
    await w.drain()
