"""A blocking facade over the async client, for code without an event loop.

Each sync :class:`DSecClient` runs one private event loop in one background
thread (not a thread per call) and hands every call to it. Calls from many
threads may share one client; they are multiplexed on that loop and its
connection pool exactly like concurrent coroutines::

    from libdsec.sync import DSecClient
    from libdsec import DSecContainerRunArgs

    with DSecClient() as client:
        with client.run_container(DSecContainerRunArgs(container_image="base/python:3.11")) as sb:
            print(sb.run_shell("echo hi").stdout)

Methods take the same arguments and return the same types as their async
counterparts (sandboxes, sessions and streams come back as the sync
wrappers below). Do not call the sync client from inside its own loop.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable, Iterator, Optional, TypeVar

from . import client as _aclient
from . import sandbox as _asandbox
from . import terminal as _aterminal
from .types import ExecChunk, ExecResult, ExecStatus

__all__ = ["DSecClient", "Sandbox", "Session", "ExecStream", "Terminal"]

T = TypeVar("T")


class _LoopThread:
    """An event loop running forever in one daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name="libdsec-loop", daemon=True)
        self.thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def run(self, aw: Awaitable[T]) -> T:
        if threading.current_thread() is self.thread:
            raise RuntimeError("libdsec.sync called from its own event loop; use the async client there")
        if self.loop.is_closed():
            raise RuntimeError("libdsec.sync client is closed")

        async def wrap() -> T:
            return await aw

        fut = asyncio.run_coroutine_threadsafe(wrap(), self.loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()  # KeyboardInterrupt in the caller: stop the call too
            raise

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


def _fwd(name: str, doc_from: type, wrap: Optional[Callable[[Any, Any], Any]] = None) -> Callable[..., Any]:
    """A sync method running the async method ``name`` of ``self._a``."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        res = self._lt.run(getattr(self._a, name)(*args, **kwargs))
        return wrap(self, res) if wrap is not None else res

    method.__name__ = name
    method.__qualname__ = name
    method.__doc__ = getattr(doc_from, name).__doc__
    return method


class Sandbox:
    """Blocking wrapper of :class:`libdsec.Sandbox`; ``with sandbox:``
    deletes it at the end of the block."""

    def __init__(self, lt: _LoopThread, a: _asandbox.Sandbox) -> None:
        self._lt = lt
        self._a = a

    @property
    def id(self) -> str:
        return self._a.id

    @property
    def info(self) -> Any:
        return self._a.info

    @property
    def state(self) -> str:
        return self._a.state

    @property
    def labels(self) -> dict[str, str]:
        return self._a.labels

    @property
    def aio(self) -> _asandbox.Sandbox:
        """The underlying async sandbox."""
        return self._a

    def __repr__(self) -> str:
        return f"sync.{self._a!r}"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._lt.run(self._a.__aexit__(exc_type, exc, tb))

    refresh = _fwd("refresh", _asandbox.Sandbox)
    stop = _fwd("stop", _asandbox.Sandbox)
    delete = stop
    keepalive = _fwd("keepalive", _asandbox.Sandbox)
    stats = _fwd("stats", _asandbox.Sandbox)
    pause = _fwd("pause", _asandbox.Sandbox)
    resume = _fwd("resume", _asandbox.Sandbox)
    snapshot = _fwd("snapshot", _asandbox.Sandbox)
    fork = _fwd("fork", _asandbox.Sandbox, lambda self, sbs: [Sandbox(self._lt, s) for s in sbs])
    log = _fwd("log", _asandbox.Sandbox)
    log_all = _fwd("log_all", _asandbox.Sandbox)
    exec = _fwd("exec", _asandbox.Sandbox)
    run_shell = _fwd("run_shell", _asandbox.Sandbox)
    read_file = _fwd("read_file", _asandbox.Sandbox)
    download_file = _fwd("download_file", _asandbox.Sandbox)
    write_file = _fwd("write_file", _asandbox.Sandbox)
    list_dir = _fwd("list_dir", _asandbox.Sandbox)
    stat = _fwd("stat", _asandbox.Sandbox)
    remove = _fwd("remove", _asandbox.Sandbox)
    upload_dir = _fwd("upload_dir", _asandbox.Sandbox)
    upload_tar = _fwd("upload_tar", _asandbox.Sandbox)
    download_tar = _fwd("download_tar", _asandbox.Sandbox)
    download_dir = _fwd("download_dir", _asandbox.Sandbox)

    def exec_stream(self, command: Any, **kwargs: Any) -> "ExecStream":
        """Run a command and iterate over its output chunks as they come
        (see :meth:`libdsec.Sandbox.exec_stream`)."""
        return ExecStream(self._lt, self._a.exec_stream(command, **kwargs))

    def session(self, **kwargs: Any) -> "Session":
        """A persistent shell; ``with sandbox.session() as s: s.run(...)``."""
        return Session(self._lt, self._a.session(**kwargs))

    def pty(
        self,
        cols: int = 80,
        rows: int = 24,
        cmd: Optional[str] = None,
        shell: Optional[str] = None,
        user: Optional[str] = None,
        *,
        timeout: Optional[float] = None,
    ) -> "Terminal":
        """An interactive terminal (see :meth:`libdsec.Sandbox.pty`);
        ``with sandbox.pty() as term:`` closes it at the end."""
        start = self._a.pty(cols, rows, cmd, shell, user, timeout=timeout)
        return Terminal(self._lt, self._lt.run(start))


class Session:
    """Blocking wrapper of :class:`libdsec.Session`."""

    def __init__(self, lt: _LoopThread, a: _asandbox.Session) -> None:
        self._lt = lt
        self._a = a

    @property
    def id(self) -> Optional[str]:
        return self._a.id

    def open(self) -> "Session":
        """Start the shell (a no-op if already open)."""
        self._lt.run(self._a.open())
        return self

    run = _fwd("run", _asandbox.Session)
    close = _fwd("close", _asandbox.Session)

    def __enter__(self) -> "Session":
        return self.open()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._lt.run(self._a.__aexit__(exc_type, exc, tb))


class ExecStream:
    """Blocking iterator over the output of a streaming exec; ``status``
    is set after the last chunk."""

    def __init__(self, lt: _LoopThread, a: _asandbox.ExecStream) -> None:
        self._lt = lt
        self._a = a

    @property
    def status(self) -> Optional[ExecStatus]:
        return self._a.status

    def __iter__(self) -> Iterator[ExecChunk]:
        return self

    def __next__(self) -> ExecChunk:
        try:
            return self._lt.run(self._a.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def wait(self) -> ExecStatus:
        """Read the rest of the output; return the status."""
        return self._lt.run(self._a.wait())

    def collect(self) -> ExecResult:
        """Read the rest of the output into an ExecResult."""
        return self._lt.run(self._a.collect())

    def close(self) -> None:
        """Stop reading (drops the connection if the command still runs)."""
        self._lt.run(self._a.aclose())

    def __enter__(self) -> "ExecStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Terminal:
    """Blocking wrapper of :class:`libdsec.Terminal`: iterating gives the
    output until the shell ends; ``exit_code`` is then set."""

    def __init__(self, lt: _LoopThread, a: _aterminal.Terminal) -> None:
        self._lt = lt
        self._a = a

    @property
    def sandbox_id(self) -> str:
        return self._a.sandbox_id

    @property
    def exit_code(self) -> Optional[int]:
        return self._a.exit_code

    @property
    def status(self) -> Optional[str]:
        return self._a.status

    @property
    def aio(self) -> _aterminal.Terminal:
        """The underlying async terminal."""
        return self._a

    def __repr__(self) -> str:
        return f"sync.{self._a!r}"

    read = _fwd("read", _aterminal.Terminal)
    write = _fwd("write", _aterminal.Terminal)
    resize = _fwd("resize", _aterminal.Terminal)
    wait = _fwd("wait", _aterminal.Terminal)
    close = _fwd("close", _aterminal.Terminal)

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        data = self._lt.run(self._a.read())
        if not data:
            raise StopIteration
        return data

    def __enter__(self) -> "Terminal":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class DSecClient:
    """Blocking client; takes the arguments of :class:`libdsec.DSecClient`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._a = _aclient.DSecClient(*args, **kwargs)
        self._lt = _LoopThread()

    @property
    def endpoint(self) -> str:
        return self._a.endpoint

    @property
    def aio(self) -> _aclient.DSecClient:
        """The underlying async client (bound to the facade's own loop)."""
        return self._a

    def __repr__(self) -> str:
        return f"sync.{self._a!r}"

    def _sb(self, a: _asandbox.Sandbox) -> Sandbox:
        return Sandbox(self._lt, a)

    def open(self) -> "DSecClient":
        """Check that the endpoint answers."""
        self._lt.run(self._a.open())
        return self

    def close(self) -> None:
        """Close the connections and stop the client's thread."""
        if self._lt.loop.is_closed():
            return
        try:
            self._lt.run(self._a.close())
        finally:
            self._lt.stop()

    def __enter__(self) -> "DSecClient":
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    health = _fwd("health", _aclient.DSecClient)

    def run_container(self, args: Any, *, timeout: Optional[float] = None) -> Sandbox:
        """Create a sandbox and return it once it runs; ``with
        client.run_container(args) as sb:`` deletes it at the end."""
        return self._sb(self._lt.run(self._a.run_container(args, timeout=timeout)))

    def create_batch(self, args: Any, count: int, *, timeout: Optional[float] = None) -> _aclient.BatchResult:
        """Batch create; the result's sandboxes are sync wrappers."""
        res = self._lt.run(self._a.create_batch(args, count, timeout=timeout))
        return _aclient.BatchResult([self._sb(s) for s in res.sandboxes], res.errors)  # type: ignore[misc]

    run_containers = _fwd("run_containers", _aclient.DSecClient, lambda self, sbs: [self._sb(s) for s in sbs])
    get = _fwd("get", _aclient.DSecClient, lambda self, s: self._sb(s))
    list = _fwd("list", _aclient.DSecClient, lambda self, sbs: [self._sb(s) for s in sbs])
    delete = _fwd("delete", _aclient.DSecClient)
    delete_sandbox = _fwd("delete_sandbox", _aclient.DSecClient)
    pause = _fwd("pause", _aclient.DSecClient)
    resume = _fwd("resume", _aclient.DSecClient)
    list_layers = _fwd("list_layers", _aclient.DSecClient)
    get_layer = _fwd("get_layer", _aclient.DSecClient)
    delete_layer = _fwd("delete_layer", _aclient.DSecClient)
    gc_layers = _fwd("gc_layers", _aclient.DSecClient)
    nodes = _fwd("nodes", _aclient.DSecClient)
    create_project = _fwd("create_project", _aclient.DSecClient)
    get_project = _fwd("get_project", _aclient.DSecClient)
    list_projects = _fwd("list_projects", _aclient.DSecClient)
    update_project = _fwd("update_project", _aclient.DSecClient)
    delete_project = _fwd("delete_project", _aclient.DSecClient)
    create_key = _fwd("create_key", _aclient.DSecClient)
    list_keys = _fwd("list_keys", _aclient.DSecClient)
    revoke_key = _fwd("revoke_key", _aclient.DSecClient)
    whoami = _fwd("whoami", _aclient.DSecClient)
    list_audit = _fwd("list_audit", _aclient.DSecClient)

    def sandbox(self, sandbox_id: str) -> Sandbox:
        """A handle on an existing sandbox, without asking the server."""
        return self._sb(self._a.sandbox(sandbox_id))
