"""Sandbox, Session and ExecStream: what you do with a running sandbox
(terminals are in terminal.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union
from urllib.parse import quote

from . import _http, _tar
from .errors import NotFound, ProtocolError, error_from_code
from .terminal import TerminalStart, open_terminal
from .types import (
    ExecChunk,
    ExecResult,
    ExecStatus,
    FileEntry,
    Layer,
    LogEntry,
    LogPage,
    PauseResult,
    SandboxInfo,
    Stats,
    TarResult,
)

if TYPE_CHECKING:
    from .client import DSecClient, _Deadline

__all__ = ["Sandbox", "Session", "ExecStream", "Command"]

log = logging.getLogger("libdsec")

#: A command: a string runs under ``/bin/sh -c``; a sequence of strings is
#: an argv run directly, without a shell.
Command = Union[str, Sequence[str]]

# Default command timeout of the API (seconds); bounds the call when the
# caller gives none.
_DEFAULT_EXEC_TIMEOUT = 60


def _esc(s: str) -> str:
    return quote(s, safe="")


def _exec_body(
    command: Command,
    cwd: Optional[str],
    env: Optional[Mapping[str, str]],
    user: Optional[str],
    stdin: Union[str, bytes, None],
    timeout: Optional[int],
    max_output_bytes: Optional[int],
    private: bool = False,
) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if private:
        body["private"] = True
    if isinstance(command, str):
        body["cmd"] = command
    else:
        argv = list(command)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise TypeError("command must be a string or a non-empty sequence of strings")
        body["argv"] = argv
    if cwd:
        body["cwd"] = cwd
    if env:
        body["env"] = dict(env)
    if user:
        body["user"] = user
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        body["stdin_b64"] = base64.b64encode(bytes(stdin)).decode()
    elif stdin is not None:
        body["stdin"] = stdin
    if timeout:
        body["timeout"] = int(timeout)
    if max_output_bytes:
        body["max_output_bytes"] = int(max_output_bytes)
    return body


class Sandbox:
    """A sandbox of a :class:`~libdsec.DSecClient`.

    ``async with sandbox:`` deletes it when the block ends, whatever happens
    in the block. Any exec, session or files call on a paused sandbox resumes
    it first (server side).
    """

    def __init__(self, client: "DSecClient", info: SandboxInfo) -> None:
        self._client = client
        #: The sandbox as last described by the server.
        self.info = info

    @property
    def id(self) -> str:
        """Sandbox ID, ``sb-<edge>-<random>``."""
        return self.info.id

    @property
    def state(self) -> str:
        """State as last seen (call :meth:`refresh` for the current one)."""
        return self.info.state

    @property
    def labels(self) -> dict[str, str]:
        return self.info.labels

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, state={self.state!r})"

    def _path(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{_esc(self.id)}{suffix}"

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            await self.stop()
        except Exception as e:
            if exc_type is None:
                raise
            # The block's own error matters more; the sandbox still ends at
            # its idle timeout or TTL.
            log.warning("deleting sandbox %s after an error: %s", self.id, e)

    # -- lifecycle ------------------------------------------------------

    async def refresh(self) -> SandboxInfo:
        """Fetch the sandbox's current description."""
        self.info = SandboxInfo.from_json(await self._client._call("GET", self._path()))
        return self.info

    async def stop(self) -> None:
        """Delete the sandbox and release everything it held. Idempotent."""
        await self._client._call("DELETE", self._path())

    delete = stop

    async def keepalive(self, ttl: int = 0) -> SandboxInfo:
        """Make the sandbox expire ``ttl`` seconds from now (0: its own TTL
        from its spec, again)."""
        doc = await self._client._call("POST", self._path("/keepalive"), json_body={"ttl": int(ttl)}, idempotent=True)
        self.info = SandboxInfo.from_json(doc)
        return self.info

    async def set_network(self, allow: "list[str] | None" = None, deny: "list[str] | None" = None) -> SandboxInfo:
        """Replace the sandbox's egress policy, live: connections the new
        policy does not permit stop at once. ``set_network()`` makes the
        sandbox loopback-only again."""
        body: dict[str, Any] = {}
        if allow:
            body["allow"] = list(allow)
        if deny:
            body["deny"] = list(deny)
        doc = await self._client._call("PUT", self._path("/network"), json_body=body, idempotent=True)
        self.info = SandboxInfo.from_json(doc)
        return self.info

    async def set_network_rules(self, rules: "dict[str, bool]") -> SandboxInfo:
        """``set_network`` in ``network_rules`` form: names set True are
        allowed, names set False denied."""
        for name, ok in rules.items():
            if not isinstance(ok, bool):
                raise TypeError(f"network_rules[{name!r}] must be True or False, got {ok!r}")
        return await self.set_network([n for n, ok in rules.items() if ok], [n for n, ok in rules.items() if not ok])

    def port_url(self, port: int) -> str:
        """The URL under which the API proxies HTTP to ``port`` on the
        sandbox's loopback. Requests need the API key (sent as
        ``Authorization: Bearer``), which is not passed on to the sandbox."""
        return f"{self._client.endpoint}{self._path(f'/ports/{int(port)}/')}"

    async def stats(self) -> Stats:
        """Current resource use (CPU time, memory, pids, disk)."""
        return Stats.from_json(await self._client._call("GET", self._path("/stats")))

    async def pause(self) -> PauseResult:
        """Freeze the sandbox and reclaim its memory. Pausing a paused
        sandbox succeeds and frees nothing."""
        doc = await self._client._call("POST", self._path("/pause"), idempotent=True)
        res = PauseResult.from_json(doc)
        self.info = res.sandbox
        return res

    async def resume(self) -> SandboxInfo:
        """Thaw a paused sandbox (a running one is left as is)."""
        doc = await self._client._call("POST", self._path("/resume"), idempotent=True)
        self.info = SandboxInfo.from_json(doc)
        return self.info

    async def snapshot(
        self,
        ref: str,
        *,
        include: Optional[Sequence[str]] = None,
        exclude: Optional[Sequence[str]] = None,
        timeout: Optional[float] = None,
    ) -> Layer:
        """Pack the sandbox's writable state into a snapshot layer named
        ``ref`` (``snapshot/NAME:TAG``). ``include`` keeps only those paths;
        ``exclude`` scrubs paths (e.g. ``/root/.cache``). Start sandboxes from
        it with ``DSecContainerRunArgs(snapshot=ref)``."""
        body: dict[str, Any] = {"ref": ref}
        if include:
            body["include"] = list(include)
        if exclude:
            body["exclude"] = list(exclude)
        doc = await self._client._call("POST", self._path("/snapshot"), json_body=body, timeout=timeout, keyed=True)
        return Layer.from_json(doc)

    async def fork(
        self,
        count: int = 1,
        *,
        labels: Optional[Mapping[str, str]] = None,
        allow_partial: bool = False,
        timeout: Optional[float] = None,
    ) -> "list[Sandbox]":
        """Start ``count`` sandboxes from this one's current state. They keep
        its labels (less dsec's own, ``dsec.*``), plus ``labels``, which may
        not start with ``dsec.``. All or nothing unless ``allow_partial``
        (see ``DSecClient.run_containers``)."""
        body: dict[str, Any] = {"count": int(count)}
        if labels:
            body["labels"] = dict(labels)
        path = self._path("/fork")
        doc = await self._client._call("POST", path, json_body=body, timeout=timeout, keyed=True)
        res = self._client._batch_result(doc, path)
        return await self._client._settle(res, allow_partial, f"fork of {self.id}")

    async def log(self, since_seq: int = 0, limit: Optional[int] = None) -> LogPage:
        """One page of the sandbox's command log: entries after ``since_seq``."""
        q: list[tuple[str, str]] = []
        if since_seq:
            q.append(("since_seq", str(int(since_seq))))
        if limit:
            q.append(("limit", str(int(limit))))
        return LogPage.from_json(await self._client._call("GET", self._path("/log"), query=q))

    async def log_all(self, since_seq: int = 0) -> "list[LogEntry]":
        """The command log from ``since_seq`` to its end."""
        out: list[LogEntry] = []
        while True:
            page = await self.log(since_seq)
            if not page.entries:
                return out
            if page.next_seq <= since_seq:
                raise ProtocolError(f"server returned next_seq {page.next_seq} for since_seq {since_seq}")
            out.extend(page.entries)
            since_seq = page.next_seq

    # -- exec -----------------------------------------------------------

    def _exec_timeout(self, timeout: Optional[int]) -> float:
        return (timeout or _DEFAULT_EXEC_TIMEOUT) + self._client.exec_grace

    async def exec(
        self,
        command: Command,
        *,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        user: Optional[str] = None,
        stdin: Union[str, bytes, None] = None,
        timeout: Optional[int] = None,
        max_output_bytes: Optional[int] = None,
        private: bool = False,
    ) -> ExecResult:
        """Run one command and wait for it.

        ``command`` is a string (run under ``/bin/sh -c``) or an argv list
        (run directly). ``timeout`` is the command's limit in whole seconds
        (server default 60); a command that passes it is killed and comes
        back with ``timed_out`` set, not as an exception. ``stdin`` as bytes
        is sent binary-safe. ``private`` runs it where the sandbox's own
        processes cannot see, signal or read it (for graders; what it
        starts ends with it). Exec is never retried once sent.
        """
        body = _exec_body(command, cwd, env, user, stdin, timeout, max_output_bytes, private)
        doc = await self._client._call(
            "POST", self._path("/exec"), json_body=body, timeout=self._exec_timeout(timeout), keyed="if-asked"
        )
        return ExecResult.from_json(doc or {})

    async def run_shell(self, cmd: str, **kw: Any) -> ExecResult:
        """Run a shell command line (``/bin/sh -c cmd``); see :meth:`exec`."""
        if not isinstance(cmd, str):
            raise TypeError("run_shell takes a command line string; use exec() for an argv")
        return await self.exec(cmd, **kw)

    def exec_stream(
        self,
        command: Command,
        *,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        user: Optional[str] = None,
        stdin: Union[str, bytes, None] = None,
        timeout: Optional[int] = None,
        max_output_bytes: Optional[int] = None,
    ) -> "ExecStream":
        """Run one command and read its output as it is produced::

            async with sandbox.exec_stream("make test") as stream:
                async for chunk in stream:          # ExecChunk(stream, data)
                    print(chunk.stream, chunk.text, end="")
            print(stream.status.exit_code)

        The request is sent when iteration starts. Leaving the block early
        (or :meth:`ExecStream.aclose`) drops the connection, which stops a
        command whose output nobody reads any more.
        """
        body = _exec_body(command, cwd, env, user, stdin, timeout, max_output_bytes)
        return ExecStream(self, body, self._exec_timeout(timeout))

    def session(
        self,
        *,
        shell: Optional[str] = None,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        user: Optional[str] = None,
    ) -> "Session":
        """A persistent shell whose state (cwd, variables, functions) carries
        over between runs. Use ``async with sandbox.session() as s:`` (closed
        at the end), or ``await s.open()`` / ``await s.close()``."""
        return Session(self, shell=shell, cwd=cwd, env=env, user=user)

    def pty(
        self,
        cols: int = 80,
        rows: int = 24,
        cmd: Optional[str] = None,
        shell: Optional[str] = None,
        user: Optional[str] = None,
        *,
        timeout: Optional[float] = None,
    ) -> TerminalStart:
        """An interactive terminal: a login shell (bash if the sandbox has
        it, else sh) under a pseudo-terminal of ``cols`` x ``rows``, with
        ``TERM=xterm-256color``::

            async with sandbox.pty(cols=120, rows=40) as term:
                await term.write("ls\\n")
                print(await term.read())
                await term.write("exit 3\\n")
                code = await term.wait()            # 3

        ``cmd`` runs that command under ``/bin/sh -c`` instead, ``shell``
        another shell (an absolute path), ``user`` as another user. Also
        ``term = await sandbox.pty()``; then ``await term.close()``, which
        kills the shell if it still runs. ``timeout`` bounds opening it
        (default: the client's). See :class:`~libdsec.Terminal`.
        """
        return open_terminal(self, cols, rows, cmd, shell, user, timeout)

    # -- files ----------------------------------------------------------

    async def read_file(self, path: str, *, timeout: Optional[float] = None) -> bytes:
        """The exact bytes of a file (NotFound if it is absent)."""
        return await self._client._call(
            "GET", self._path("/files"), query=[("path", path)], accept="application/octet-stream", raw=True, timeout=timeout
        )

    async def download_file(self, path: str, local_path: "os.PathLike[str] | str", *, timeout: Optional[float] = None) -> int:
        """Stream a file of the sandbox to a local file; returns its size."""
        dl = self._client._deadline(timeout, f"download {path}")
        resp = await self._client._send(
            "GET", self._path("/files"), query=[("path", path)], accept="application/octet-stream", deadline=dl
        )
        n = 0
        try:
            with open(local_path, "wb") as f:
                while True:
                    data = await dl.run(resp.read_some())
                    if not data:
                        return n
                    f.write(data)
                    n += len(data)
        finally:
            resp.close()

    async def write_file(
        self, path: str, data: Union[bytes, str], *, mode: Union[int, str, None] = None, timeout: Optional[float] = None
    ) -> FileEntry:
        """Create or replace a file (parents are created). ``data`` as str is
        written UTF-8. ``mode`` is the permission bits, e.g. ``0o755``."""
        if isinstance(data, str):
            data = data.encode()
        q = [("path", path)]
        if mode is not None:
            q.append(("mode", f"{mode:04o}" if isinstance(mode, int) else mode))
        doc = await self._client._call(
            "PUT", self._path("/files"), query=q, body=bytes(data), content_type="application/octet-stream", timeout=timeout
        )
        return FileEntry.from_json(doc or {"path": path})

    async def list_dir(self, path: str, depth: int = 1) -> "list[FileEntry]":
        """The entries under ``path`` (not ``path`` itself), ``depth`` levels down."""
        q = [("path", path)]
        if depth and depth != 1:
            q.append(("depth", str(int(depth))))
        doc = await self._client._call("GET", self._path("/files:list"), query=q) or {}
        return [FileEntry.from_json(e) for e in doc.get("entries") or []]

    async def stat(self, path: str) -> FileEntry:
        """Describe one path (a final symlink is not followed)."""
        return FileEntry.from_json(await self._client._call("GET", self._path("/files:stat"), query=[("path", path)]))

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Delete a file, or a directory tree with ``recursive``."""
        q = [("path", path)]
        if recursive:
            q.append(("recursive", "true"))
        await self._client._call("DELETE", self._path("/files"), query=q)

    async def upload_dir(self, local_dir: "os.PathLike[str] | str", remote_dir: str, *, timeout: Optional[float] = None) -> TarResult:
        """Copy the contents of a local directory into ``remote_dir`` (created
        if missing) as one tar upload. Files are owned by root in the sandbox."""
        loop = asyncio.get_running_loop()
        f = await loop.run_in_executor(None, _tar.pack_dir, os.fspath(local_dir))
        try:
            doc = await self._client._call(
                "PUT",
                self._path("/files:tar"),
                query=[("path", remote_dir)],
                body=f,
                content_type="application/x-tar",
                timeout=timeout,
            )
        finally:
            f.close()
        return TarResult.from_json(doc or {})

    async def upload_tar(self, remote_dir: str, data: bytes, *, timeout: Optional[float] = None) -> TarResult:
        """Extract a tar (plain or gzip'd, as bytes) into ``remote_dir``."""
        ctype = "application/gzip" if data[:2] == b"\x1f\x8b" else "application/x-tar"
        doc = await self._client._call(
            "PUT", self._path("/files:tar"), query=[("path", remote_dir)], body=data, content_type=ctype, timeout=timeout
        )
        return TarResult.from_json(doc or {})

    async def download_tar(self, remote_dir: str, *, timeout: Optional[float] = None) -> bytes:
        """A tar of ``remote_dir`` and everything under it, as bytes."""
        return await self._client._call(
            "GET", self._path("/files:tar"), query=[("path", remote_dir)], accept="application/x-tar", raw=True, timeout=timeout
        )

    async def download_dir(
        self, remote_dir: str, local_dir: "os.PathLike[str] | str", *, timeout: Optional[float] = None
    ) -> "list[str]":
        """Copy ``remote_dir`` and everything under it into ``local_dir``
        (created if missing); returns the names extracted.

        The archive is checked before anything is written: an entry that
        would land outside ``local_dir`` (absolute, ``..``, or a link
        pointing out) raises :class:`~libdsec.UnsafeArchive` and nothing is
        extracted. Device files and FIFOs are skipped.
        """
        import tempfile

        dl = self._client._deadline(timeout, f"download_dir {remote_dir}")
        resp = await self._client._send(
            "GET", self._path("/files:tar"), query=[("path", remote_dir)], accept="application/x-tar", deadline=dl
        )
        f = tempfile.SpooledTemporaryFile(max_size=_tar.SPOOL_BYTES)
        try:
            try:
                while True:
                    data = await dl.run(resp.read_some())
                    if not data:
                        break
                    f.write(data)
            finally:
                resp.close()
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, _tar.unpack, f, os.fspath(local_dir))
        finally:
            f.close()


class Session:
    """A persistent shell in a sandbox (see :meth:`Sandbox.session`)."""

    def __init__(
        self,
        sandbox: Sandbox,
        *,
        shell: Optional[str] = None,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        user: Optional[str] = None,
    ) -> None:
        self.sandbox = sandbox
        #: The session ID once open.
        self.id: Optional[str] = None
        self._req: dict[str, Any] = {}
        if shell:
            self._req["shell"] = shell
        if cwd:
            self._req["cwd"] = cwd
        if env:
            self._req["env"] = dict(env)
        if user:
            self._req["user"] = user

    def __repr__(self) -> str:
        return f"Session(sandbox={self.sandbox.id!r}, id={self.id!r})"

    async def open(self) -> "Session":
        """Start the shell (a no-op if already open)."""
        if self.id is None:
            doc = await self.sandbox._client._call("POST", self.sandbox._path("/sessions"), json_body=self._req)
            self.id = str((doc or {}).get("session_id", ""))
            if not self.id:
                raise ProtocolError("session create answered without a session_id")
        return self

    async def run(self, command: str, *, timeout: Optional[int] = None, max_output_bytes: Optional[int] = None) -> ExecResult:
        """Run a command line in the session's shell and wait for it. State
        it changes (``cd``, ``export``, functions) is seen by later runs."""
        if self.id is None:
            await self.open()
        body: dict[str, Any] = {"command": command}
        if timeout:
            body["timeout"] = int(timeout)
        if max_output_bytes:
            body["max_output_bytes"] = int(max_output_bytes)
        doc = await self.sandbox._client._call(
            "POST",
            self.sandbox._path(f"/sessions/{_esc(self.id or '')}/run"),
            json_body=body,
            timeout=self.sandbox._exec_timeout(timeout),
            keyed="if-asked",
        )
        return ExecResult.from_json(doc or {})

    async def close(self) -> None:
        """Kill the shell and its process tree. Closing a session that is
        already gone (or a sandbox that is) is not an error."""
        if self.id is None:
            return
        sid, self.id = self.id, None
        try:
            await self.sandbox._client._call("DELETE", self.sandbox._path(f"/sessions/{_esc(sid)}"))
        except NotFound:
            pass

    async def __aenter__(self) -> "Session":
        return await self.open()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            await self.close()
        except Exception as e:
            if exc_type is None:
                raise
            log.warning("closing session of %s after an error: %s", self.sandbox.id, e)


_OUTPUT_KEYS = (("stdout", "stdout", False), ("stderr", "stderr", False), ("stdout_b64", "stdout", True), ("stderr_b64", "stderr", True))


class ExecStream:
    """Output of a streaming exec, as an async iterator of :class:`ExecChunk`.

    After the last chunk, :attr:`status` holds how the command ended. An
    error the server reports after the stream began is raised from the
    iteration as the exception of its code.
    """

    def __init__(self, sandbox: Sandbox, body: dict[str, Any], timeout: float) -> None:
        self._sandbox = sandbox
        self._body = body
        self._timeout = timeout
        self._deadline: Optional["_Deadline"] = None
        self._resp: Optional[_http.Response] = None
        self._buf = bytearray()
        self._eof = False
        #: Final status, set once the stream has ended.
        self.status: Optional[ExecStatus] = None

    async def _start(self) -> None:
        c = self._sandbox._client
        self._deadline = c._deadline(self._timeout, f"exec_stream in {self._sandbox.id}")
        self._resp = await c._send(
            "POST",
            self._sandbox._path("/exec"),
            query=[("stream", "true")],
            json_body=self._body,
            accept="application/x-ndjson",
            keyed="if-asked",
            deadline=self._deadline,
        )

    async def _next_line(self) -> Optional[bytes]:
        assert self._resp is not None and self._deadline is not None
        while True:
            i = self._buf.find(b"\n")
            if i >= 0:
                line = bytes(self._buf[:i])
                del self._buf[: i + 1]
                return line
            if self._eof:
                if self._buf:
                    line = bytes(self._buf)
                    self._buf.clear()
                    return line
                return None
            data = await self._deadline.run(self._resp.read_some())
            if not data:
                self._eof = True
            self._buf += data

    def __aiter__(self) -> "ExecStream":
        return self

    async def __anext__(self) -> ExecChunk:
        if self.status is not None:
            raise StopAsyncIteration
        try:
            if self._resp is None:
                await self._start()
            while True:
                line = await self._next_line()
                if line is None:
                    raise ProtocolError("exec stream ended without a final event")
                if not line.strip():
                    continue
                try:
                    ev = json.loads(line)
                except ValueError as e:
                    raise ProtocolError(f"bad exec stream line: {e}") from None
                if ev.get("error"):
                    err = ev["error"]
                    raise error_from_code(str(err.get("code", "")), str(err.get("message", "")), path=self._sandbox._path("/exec"))
                if "exit_code" in ev:
                    self.status = ExecStatus(
                        exit_code=int(ev.get("exit_code") or 0),
                        timed_out=bool(ev.get("timed_out")),
                        truncated=bool(ev.get("truncated")),
                        duration_ms=int(ev.get("duration_ms") or 0),
                    )
                    await self._drain()
                    raise StopAsyncIteration
                for key, stream, b64 in _OUTPUT_KEYS:
                    if key in ev:
                        v = ev[key] or ""
                        return ExecChunk(stream, base64.b64decode(v) if b64 else v.encode())
        except BaseException as e:
            if not isinstance(e, StopAsyncIteration):
                await self.aclose()
            raise

    async def _drain(self) -> None:
        # The final event is the last line; reading to the end returns the
        # connection to the pool. Anything unexpected after it just drops it.
        try:
            while not self._eof and self._resp is not None:
                data = await self._deadline.run(self._resp.read_some())  # type: ignore[union-attr]
                if not data:
                    self._eof = True
        finally:
            await self.aclose()

    async def wait(self) -> ExecStatus:
        """Read (and discard) the rest of the output; return the status."""
        async for _ in self:
            pass
        assert self.status is not None
        return self.status

    async def collect(self) -> ExecResult:
        """Read the rest of the output into an :class:`ExecResult`."""
        out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        async for ch in self:
            out[ch.stream] += ch.data
        st = self.status
        assert st is not None
        ob, eb = bytes(out["stdout"]), bytes(out["stderr"])
        return ExecResult(
            exit_code=st.exit_code,
            stdout=ob.decode("utf-8", errors="replace"),
            stderr=eb.decode("utf-8", errors="replace"),
            timed_out=st.timed_out,
            truncated=st.truncated,
            duration_ms=st.duration_ms,
            stdout_bytes=ob,
            stderr_bytes=eb,
        )

    async def aclose(self) -> None:
        """Stop reading; drops the connection if the stream has not ended."""
        if self._resp is not None:
            self._resp.close()

    async def __aenter__(self) -> "ExecStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
