"""DSecClient: the asyncio client of the dsec REST API (api/openapi.yaml).

One client holds a bounded keep-alive connection pool per endpoint and is
meant to be shared by every coroutine of a process: an RL rollout worker
typically drives hundreds of sandboxes through a single client. Given the
apiservers of a cluster (``DSEC_ENDPOINT=http://a:7070,http://b:7070``), it
fails over between them.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import json
import logging
import math
import random
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Generator, Mapping, Optional, Sequence, Union
from urllib.parse import quote, urlencode, urlsplit

from . import _http
from .config import normalize_endpoints, resolve_config
from .errors import (
    BatchFailed,
    ConnectionFailed,
    DeadlineExceeded,
    DSecError,
    InvalidArgument,
    NodesUnreachable,
    ProtocolError,
    error_from_code,
    error_from_response,
)
from .sandbox import Sandbox
from .types import APIKey, AuditEntry, DSecContainerRunArgs, Layer, LayerGCResult, Node, Project, ProjectQuota, SandboxInfo, WhoAmI

__all__ = ["DSecClient", "BatchResult", "USER_AGENT", "idempotency_key"]

#: Sent with every request.
USER_AGENT = "libdsec-python/0.1"

log = logging.getLogger("libdsec")

_NO_BODY = object()

#: An Idempotency-Key the caller chose for its next keyed calls (see
#: :class:`idempotency_key`); otherwise each keyed call gets a fresh one.
_IDEM_KEY: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("libdsec_idempotency_key", default=None)


class idempotency_key:
    """Send ``key`` as the Idempotency-Key of the keyed calls (create, batch,
    fork, snapshot, fncall, exec, session run) made inside the block, so that
    a caller that repeats a whole operation (after its own restart, say) gets
    the first attempt's answer instead of a second run::

        with libdsec.idempotency_key("job-42-step-7"):
            sandbox = await client.run_container(args)

    Use one key per operation.
    """

    def __init__(self, key: str) -> None:
        if not key or len(key) > 255:
            raise InvalidArgument("an idempotency key has 1 to 255 characters")
        self._key = key
        self._token: Optional[contextvars.Token[Optional[str]]] = None

    def __enter__(self) -> "idempotency_key":
        self._token = _IDEM_KEY.set(self._key)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._token is not None
        _IDEM_KEY.reset(self._token)

# Statuses worth another try for an idempotent call: the server (or a proxy)
# says "not now", not "no".
_RETRY_STATUSES = frozenset({502, 503, 504})


def _dsec_error(raw: bytes) -> bool:
    """Whether an answer is dsec's error JSON (the cluster said so) rather
    than a gateway's page."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return False
    return isinstance(doc, dict) and isinstance(doc.get("error"), dict) and bool(doc["error"].get("code"))


def esc(segment: str) -> str:
    """Escape one path segment; refs such as ``base/python:3.11`` become a
    single segment (``base%2Fpython%3A3.11``)."""
    return quote(segment, safe="")


class _Deadline:
    """The time left to one call, shared by its retries and body reads."""

    def __init__(self, timeout: Optional[float], what: str) -> None:
        if timeout is not None and (math.isinf(timeout) or timeout <= 0):
            if timeout <= 0:
                raise InvalidArgument(f"timeout must be positive, got {timeout}")
            timeout = None
        self.timeout = timeout
        self.what = what
        self.at = None if timeout is None else asyncio.get_running_loop().time() + timeout
        self.last_error: Optional[BaseException] = None

    def remaining(self) -> Optional[float]:
        if self.at is None:
            return None
        return self.at - asyncio.get_running_loop().time()

    def expired(self) -> DeadlineExceeded:
        msg = f"{self.what}: no answer within {self.timeout:g}s"
        if self.last_error is not None:
            msg += f" (last error: {self.last_error})"
        return DeadlineExceeded(msg)

    async def run(self, aw: Any) -> Any:
        rem = self.remaining()
        if rem is None:
            return await aw
        if rem <= 0:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise self.expired()
        try:
            return await asyncio.wait_for(aw, rem)
        except asyncio.TimeoutError as e:
            if isinstance(e, DSecError):
                raise
            raise self.expired() from None


@dataclass
class BatchResult:
    """The outcome of a batch create or a fork: partial success is normal.

    ``errors`` holds ``(index, DSecError)`` pairs for the items that failed.
    """

    sandboxes: list[Sandbox] = field(default_factory=list)
    errors: list[tuple[int, DSecError]] = field(default_factory=list)


class _SandboxStart:
    """What ``run_container`` returns: await it for a Sandbox, or use it as
    ``async with`` to have the sandbox deleted when the block ends."""

    def __init__(self, start: Any) -> None:
        self._start = start
        self._sandbox: Optional[Sandbox] = None

    def __await__(self) -> Generator[Any, None, Sandbox]:
        return self._start().__await__()

    async def __aenter__(self) -> Sandbox:
        self._sandbox = await self._start()
        return self._sandbox

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._sandbox is not None:
            await self._sandbox.__aexit__(exc_type, exc, tb)


class DSecClient:
    """Async client of a dsec apiserver (or ``dsec up``).

    Args:
        endpoint: Base URL, e.g. ``http://10.0.0.5:7070`` (``host:port`` is
            taken as http), or a comma-separated list of a cluster's
            apiservers to fail over between. Default: ``DSEC_ENDPOINT``, the config file, then
            ``http://127.0.0.1:7070``.
        api_key: Bearer key. Default: ``DSEC_API_KEY``, then the config file.
        timeout: Default time limit of one call in seconds, retries included.
            Exec-like calls are bounded by the command's own timeout plus
            ``exec_grace`` instead.
        max_connections: Connections the client keeps open to the endpoint at
            most; calls beyond it wait for a free one. Every in-flight call
            holds a connection, a long exec for the whole command and a
            terminal until it is closed, so set this to at least the number
            of commands and terminals you run at once.
        max_retries: Further tries of a retry-safe call after a connection
            error or a 502/503/504, with jittered exponential backoff (plus
            one per further endpoint). Reads, deletes and PUTs are retry-safe;
            creates, batches, forks, snapshots and fncalls are made so by an
            Idempotency-Key (the server answers a repeat from its record), as
            are execs and session runs inside :class:`idempotency_key`. Other
            calls (execs without a key, opening a session) are retried only
            when the connection could not even be opened.
        backoff_base, backoff_max: Backoff of the first retry and the cap, in
            seconds; the n-th retry waits between half and all of
            ``min(backoff_max, backoff_base * 2**n)``.
        connect_timeout: Time limit of opening one connection.
        exec_grace: Seconds added to a command's timeout to bound its call.

    The client is bound to the event loop that uses it. ``await
    client.close()`` (or ``async with DSecClient() as client``) releases its
    connections.
    """

    def __init__(
        self,
        endpoint: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        timeout: float = 120.0,
        max_connections: int = 256,
        max_retries: int = 3,
        backoff_base: float = 0.1,
        backoff_max: float = 5.0,
        connect_timeout: float = 10.0,
        exec_grace: float = 30.0,
        user_agent: str = USER_AGENT,
    ) -> None:
        cfg = resolve_config(endpoint, api_key)
        #: Every endpoint the client fails over between.
        self.endpoints = normalize_endpoints(cfg.endpoint)
        self._api_key = cfg.api_key
        self._pools: list[_http.Pool] = []
        self._prefixes: list[str] = []
        for ep in self.endpoints:
            u = urlsplit(ep)
            tls = u.scheme == "https"
            assert u.hostname is not None  # normalize_endpoint checked it
            self._prefixes.append(u.path.rstrip("/"))
            self._pools.append(
                _http.Pool(
                    u.hostname,
                    u.port or (443 if tls else 80),
                    tls=tls,
                    max_connections=max_connections,
                    connect_timeout=connect_timeout,
                )
            )
        self._cur = 0
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.exec_grace = exec_grace
        self.user_agent = user_agent
        self._closed = False

    def __repr__(self) -> str:
        return f"DSecClient(endpoint={self.endpoint!r})"

    @property
    def endpoint(self) -> str:
        """The endpoint calls go to now (the last one that answered)."""
        return self.endpoints[self._cur]

    @property
    def _pool(self) -> _http.Pool:
        return self._pools[self._cur]

    # -- lifecycle ------------------------------------------------------

    async def open(self) -> "DSecClient":
        """Check that the endpoint answers (``GET /healthz``).

        Calling it is optional (calls open connections as they need them)
        but surfaces a wrong endpoint early.
        """
        await self.health()
        return self

    async def close(self) -> None:
        """Close the client's connections. Calls in flight finish first."""
        self._closed = True
        for p in self._pools:
            await p.close()

    async def __aenter__(self) -> "DSecClient":
        return await self.open()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def max_connections(self) -> int:
        """The connection bound of the pool."""
        return self._pool.max_connections

    # -- transport ------------------------------------------------------

    def _target(self, path: str, query: Optional[Sequence[tuple[str, str]]], idx: int = 0) -> str:
        t = self._prefixes[idx] + path
        if query:
            t += "?" + urlencode(list(query), quote_via=quote, safe="/")
        return t

    def _backoff(self, attempt: int) -> float:
        d = min(self.backoff_max, self.backoff_base * (2**attempt))
        return d / 2 + random.uniform(0, d / 2)

    async def _send(
        self,
        method: str,
        path: str,
        *,
        deadline: _Deadline,
        query: Optional[Sequence[tuple[str, str]]] = None,
        json_body: Any = _NO_BODY,
        body: _http.Body = None,
        content_type: Optional[str] = None,
        accept: str = "application/json",
        idempotent: Optional[bool] = None,
        keyed: Union[bool, str] = False,
        extra_headers: Sequence[tuple[str, str]] = (),
        upgrade: bool = False,
    ) -> _http.Response:
        """Send a request and return its 2xx answer with the body unread
        (with ``upgrade``, a 101 Switching Protocols answer too). ``extra_headers``
        are sent after the client's own.

        Any other status raises the exception for its error code. Retries
        (see the class doc) happen here, within ``deadline``. A keyed call
        (create, batch, fork, snapshot, fncall; exec and session runs inside
        :class:`idempotency_key`, ``keyed="if-asked"``) carries an
        Idempotency-Key, the same on every attempt, which makes it safe to
        send again. A call that could not reach an apiserver, or that a
        gateway answered with 502/503/504, goes to the next endpoint.
        """
        if self._closed:
            raise ConnectionFailed("client is closed")
        if idempotent is None:
            idempotent = method in ("GET", "HEAD", "PUT", "DELETE")
        if json_body is not _NO_BODY:
            body = json.dumps(json_body, separators=(",", ":")).encode()
            content_type = "application/json"
        headers = [("User-Agent", self.user_agent), ("Accept", accept), *extra_headers]
        if self._api_key:
            headers.append(("Authorization", f"Bearer {self._api_key}"))
        if content_type:
            headers.append(("Content-Type", content_type))
        if keyed == "if-asked":
            # Exec and session runs carry a key only when the caller chose
            # one: each record costs the server a store write.
            keyed = _IDEM_KEY.get() is not None
        if keyed:
            headers.append(("Idempotency-Key", _IDEM_KEY.get() or "dsec-" + secrets.token_hex(16)))
            idempotent = True
        start_pos = body.tell() if body is not None and hasattr(body, "seek") else None
        attempt = 0
        while True:
            if start_pos is not None:
                body.seek(start_pos)  # type: ignore[union-attr]
            idx = self._cur
            failover = False
            try:
                target = self._target(path, query, idx)
                resp = await deadline.run(self._pools[idx].send(method, target, headers, body))
                if 200 <= resp.status < 300 or (upgrade and resp.status == 101):
                    return resp
                raw = await deadline.run(_read_bounded(resp, 64 << 10))
                err: DSecError = error_from_response(resp.status, raw, method=method, path=path)
                failover = resp.status in _RETRY_STATUSES and not _dsec_error(raw)
                # A keyed call is safe to resend but not worth resending
                # for dsec's own 503 (no capacity, a node down): only when
                # the answer came from a gateway.
                retry = failover if keyed else idempotent and resp.status in _RETRY_STATUSES
            except _http.ConnectError as e:
                err, retry, failover = e, True, True  # nothing was sent
            except ConnectionFailed as e:
                err, retry, failover = e, idempotent, True
            if not retry or attempt >= self.max_retries + len(self.endpoints) - 1:
                raise err
            if failover and len(self.endpoints) > 1:
                # Another apiserver may answer; stay with it afterwards.
                self._cur = (idx + 1) % len(self.endpoints)
            deadline.last_error = err
            delay = self._backoff(attempt)
            rem = deadline.remaining()
            if rem is not None and rem <= delay:
                raise err
            log.debug("retrying %s %s in %.2fs after: %s", method, path, delay, err)
            attempt += 1
            await asyncio.sleep(delay)

    async def _call(
        self,
        method: str,
        path: str,
        *,
        timeout: Optional[float] = None,
        raw: bool = False,
        **kw: Any,
    ) -> Any:
        """One call: send, read the whole answer, decode its JSON (or return
        the bytes with ``raw``). An empty answer (204) decodes to None."""
        deadline = _Deadline(self.timeout if timeout is None else timeout, f"{method} {path}")
        resp = await self._send(method, path, deadline=deadline, **kw)
        data = await deadline.run(resp.read())
        if raw:
            return data
        if not data.strip():
            return None
        try:
            return json.loads(data)
        except ValueError as e:
            raise ProtocolError(f"{method} {path}: answer is not JSON: {e}") from None

    def _deadline(self, timeout: Optional[float], what: str) -> _Deadline:
        return _Deadline(self.timeout if timeout is None else timeout, what)

    # -- sandboxes ------------------------------------------------------

    async def health(self) -> dict[str, Any]:
        """``GET /healthz`` (no key needed): ``{"status": "ok", "node": ...}``."""
        return await self._call("GET", "/healthz", accept="*/*") or {}

    def run_container(self, args: DSecContainerRunArgs, *, timeout: Optional[float] = None) -> _SandboxStart:
        """Create a sandbox and return it once it runs.

        Use either form::

            sandbox = await client.run_container(args, timeout=120)
            async with client.run_container(args) as sandbox:  # deleted at the end
                ...

        ``timeout`` bounds the creation call (default: the client's). Create
        is not idempotent, so it is not retried after the request was sent;
        a create cut short by the timeout may still complete on the server,
        where the sandbox then ends at its idle timeout or TTL. Labels make
        such leftovers easy to delete in bulk (``client.delete(labels=...)``).
        """

        async def start() -> Sandbox:
            doc = await self._call("POST", "/v1/sandboxes", json_body=args.to_spec(), timeout=timeout, keyed=True)
            return Sandbox(self, SandboxInfo.from_json(doc))

        return _SandboxStart(start)

    async def create_batch(
        self, args: DSecContainerRunArgs, count: int, *, timeout: Optional[float] = None
    ) -> BatchResult:
        """Create ``count`` sandboxes from one spec in one call. Partial
        success is normal: the failed items are in the result's ``errors``."""
        doc = await self._call(
            "POST", "/v1/sandboxes:batch", json_body={"count": count, "spec": args.to_spec()}, timeout=timeout, keyed=True
        )
        return self._batch_result(doc, "/v1/sandboxes:batch")

    async def run_containers(
        self,
        args: DSecContainerRunArgs,
        count: int,
        *,
        timeout: Optional[float] = None,
        allow_partial: bool = False,
    ) -> list[Sandbox]:
        """Create ``count`` sandboxes from one spec (one batch call).

        All or nothing by default: if any item fails, the ones created are
        deleted and :class:`BatchFailed` is raised (its ``errors`` say which
        and why). With ``allow_partial`` the sandboxes that were created are
        returned and the failures are only logged.
        """
        res = await self.create_batch(args, count, timeout=timeout)
        return await self._settle(res, allow_partial, "batch create")

    async def _settle(self, res: BatchResult, allow_partial: bool, what: str) -> list[Sandbox]:
        if not res.errors:
            return res.sandboxes
        if allow_partial:
            for i, e in res.errors:
                log.warning("%s: item %d failed: %s", what, i, e)
            return res.sandboxes
        await asyncio.gather(*(sb.stop() for sb in res.sandboxes), return_exceptions=True)
        first = res.errors[0][1]
        raise BatchFailed(
            f"{what}: {len(res.errors)} of {len(res.errors) + len(res.sandboxes)} failed; first: {first.message}",
            code=first.code,
            status=first.status,
            errors=res.errors,
        )

    def _batch_result(self, doc: Any, path: str) -> BatchResult:
        doc = doc or {}
        res = BatchResult(sandboxes=[Sandbox(self, SandboxInfo.from_json(d)) for d in doc.get("sandboxes") or []])
        for item in doc.get("errors") or []:
            e = item.get("error") or {}
            res.errors.append(
                (int(item.get("index", -1)), error_from_code(str(e.get("code", "")), str(e.get("message", "")), path=path))
            )
        return res

    def sandbox(self, sandbox_id: str) -> Sandbox:
        """A handle on an existing sandbox, without asking the server."""
        return Sandbox(self, SandboxInfo(id=sandbox_id))

    async def get(self, sandbox_id: str) -> Sandbox:
        """Fetch one sandbox (SandboxNotFound if there is none)."""
        doc = await self._call("GET", f"/v1/sandboxes/{esc(sandbox_id)}")
        return Sandbox(self, SandboxInfo.from_json(doc))

    async def fncall(
        self,
        base: str,
        cmd: Optional[str] = None,
        *,
        argv: Optional[Sequence[str]] = None,
        files: Optional[Mapping[str, bytes]] = None,
        stdin: "str | bytes" = "",
        env: Optional[Mapping[str, str]] = None,
        timeout: int = 0,
        max_output_bytes: int = 0,
        memory_mb: int = 0,
        fetch_files: Sequence[str] = (),
    ) -> "dict[str, Any]":
        """Run a short stateless job in a fresh sandbox (``POST /v1/fncall``):
        ``files`` are written under ``/work``, the command runs there, and
        ``fetch_files`` come back. ``stdin`` may be text or bytes. Returns
        the result as a dict (``exit_code``, ``stdout``, ``stderr`` as text,
        ``stdout_bytes``/``stderr_bytes`` the exact bytes, ``timed_out``,
        ``truncated``, ``duration_ms``, ``files`` decoded to bytes,
        ``missing``)."""
        if (cmd is None) == (argv is None):
            raise TypeError("give exactly one of cmd and argv")
        body: dict[str, Any] = {"base": base}
        if cmd is not None:
            body["cmd"] = cmd
        else:
            body["argv"] = list(argv or [])
        if files:
            body["files"] = {k: base64.b64encode(v).decode() for k, v in files.items()}
        if isinstance(stdin, (bytes, bytearray, memoryview)):
            if stdin:
                body["stdin_b64"] = base64.b64encode(bytes(stdin)).decode()
        elif stdin:
            body["stdin"] = stdin
        if env:
            body["env"] = dict(env)
        if timeout:
            body["timeout"] = int(timeout)
        if max_output_bytes:
            body["max_output_bytes"] = int(max_output_bytes)
        if memory_mb:
            body["memory_mb"] = int(memory_mb)
        if fetch_files:
            body["fetch_files"] = list(fetch_files)
        doc = await self._call("POST", "/v1/fncall", json_body=body, timeout=(timeout or 60) + 60, keyed=True)
        doc["files"] = {k: base64.b64decode(v) for k, v in (doc.get("files") or {}).items()}
        doc.setdefault("missing", [])
        for name in ("stdout", "stderr"):
            exact = doc.pop(name + "_b64", None)
            text = doc.get(name) or ""
            doc[name + "_bytes"] = base64.b64decode(exact) if exact else text.encode("utf-8", "surrogateescape")
        return doc

    async def list(
        self,
        *,
        labels: Optional[Mapping[str, str]] = None,
        state: Optional[str] = None,
        page_size: Optional[int] = None,
    ) -> "list[Sandbox]":
        """List the caller's sandboxes carrying all of ``labels`` (and in
        ``state``, if given), following pagination to the end. Nodes that
        could not be asked (down or cut off) are named in a warning on the
        ``libdsec`` logger: their sandboxes are not in the list."""
        out: list[Sandbox] = []
        token = ""
        seen: set[str] = set()
        skipped: set[str] = set()
        while True:
            q: list[tuple[str, str]] = []
            if state:
                q.append(("state", state))
            for k in sorted(labels or {}):
                q.append(("label", f"{k}={labels[k]}"))  # type: ignore[index]
            if page_size:
                q.append(("limit", str(page_size)))
            if token:
                q.append(("page_token", token))
            doc = await self._call("GET", "/v1/sandboxes", query=q) or {}
            out.extend(Sandbox(self, SandboxInfo.from_json(d)) for d in doc.get("sandboxes") or [])
            skipped.update(str(n) for n in doc.get("unreachable_nodes") or [])
            token = doc.get("next_page_token") or ""
            if not token:
                if skipped:
                    log.warning("list: %d node(s) could not be asked, so their sandboxes are not listed: %s", len(skipped), ", ".join(sorted(skipped)))
                return out
            if token in seen:  # a server repeating itself would loop us forever
                raise ProtocolError(f"server repeated page token {token!r}")
            seen.add(token)

    async def delete(self, *, labels: Mapping[str, str]) -> int:
        """Delete every sandbox carrying all of ``labels``; returns how many.

        At least one label is required: none would select every sandbox.
        Raises :class:`NodesUnreachable` (with the count of those deleted)
        when some nodes could not be asked: their sandboxes are left.
        """
        if not labels:
            raise InvalidArgument("delete by labels needs at least one label")
        doc = await self._call("POST", "/v1/sandboxes:delete", json_body={"labels": dict(labels)}, idempotent=True) or {}
        n = int(doc.get("deleted", 0))
        _check_reached("deleted", n, doc, "/v1/sandboxes:delete")
        return n

    async def delete_sandbox(self, sandbox_id: str) -> None:
        """Delete one sandbox. Idempotent: an unknown id is not an error."""
        await self._call("DELETE", f"/v1/sandboxes/{esc(sandbox_id)}")

    async def pause(self, *, labels: Mapping[str, str]) -> int:
        """Pause every running sandbox carrying all of ``labels`` (e.g. a
        preempted job); returns how many were paused. Nodes that could not
        be asked raise :class:`NodesUnreachable`, as for :meth:`delete`."""
        return await self._count_by_labels("/v1/sandboxes:pause", "paused", labels)

    async def resume(self, *, labels: Mapping[str, str]) -> int:
        """Resume every paused sandbox carrying all of ``labels``; returns
        how many. Nodes that could not be asked raise
        :class:`NodesUnreachable`, as for :meth:`delete`."""
        return await self._count_by_labels("/v1/sandboxes:resume", "resumed", labels)

    async def _count_by_labels(self, path: str, done: str, labels: Mapping[str, str]) -> int:
        if not labels:
            raise InvalidArgument("at least one label is required")
        doc = await self._call("POST", path, json_body={"labels": dict(labels)}, idempotent=True) or {}
        n = int(doc.get("count", 0))
        _check_reached(done, n, doc, path)
        return n

    # -- layers and nodes -----------------------------------------------

    async def list_layers(self, kind: Optional[str] = None) -> "list[Layer]":
        """List the layer catalog, optionally one kind (base, workspace,
        toolkit, snapshot)."""
        q = [("kind", kind)] if kind else None
        doc = await self._call("GET", "/v1/layers", query=q) or {}
        return [Layer.from_json(d) for d in doc.get("layers") or []]

    async def get_layer(self, ref_or_digest: str) -> Layer:
        """Look a layer up by ref (``base/python:3.11``) or digest."""
        return Layer.from_json(await self._call("GET", f"/v1/layers/{esc(ref_or_digest)}"))

    async def delete_layer(self, ref: str) -> None:
        """Remove a ref from the catalog (FailedPrecondition while in use)."""
        await self._call("DELETE", f"/v1/layers/{esc(ref)}")

    async def gc_layers(self, *, dry_run: bool = False) -> LayerGCResult:
        """Remove the layer blobs that no ref names and no sandbox on any
        node uses (images of refs re-pointed with replace, what an
        interrupted build left). With ``dry_run``, only list what would go.
        Takes a builder or admin key of the root project; an unanswering
        node makes it Unavailable, having removed nothing it could not
        check."""
        q = [("dry_run", "true")] if dry_run else None
        # A dry run is sent again like a read; a gc is not once it was sent:
        # its answer lost, a second run would report nothing removed.
        doc = await self._call("POST", "/v1/layers:gc", query=q, idempotent=dry_run) or {}
        return LayerGCResult.from_json(doc)

    async def nodes(self) -> "list[Node]":
        """The edges the apiserver knows."""
        doc = await self._call("GET", "/v1/nodes") or {}
        return [Node.from_json(d) for d in doc.get("nodes") or []]

    # -- projects, keys and audit ---------------------------------------
    #
    # The server enforces the roles (viewer < member < builder < admin) and
    # the scope rule: a key acts on its own project and those below it.
    # Project and key creates carry no Idempotency-Key: the server would
    # keep the answer for repeats, and a key's answer holds its secret. So
    # they are sent again only when the connection could not be opened; a
    # create left without an answer is checked with get_project or
    # list_keys before it is tried again.

    async def create_project(
        self,
        name: str,
        *,
        parent: str,
        quota: Optional[ProjectQuota] = None,
        dedicated_nodes: bool = False,
    ) -> Project:
        """Create project ``name`` below ``parent`` (a project id or
        ``"root"``). ``quota`` bounds the project with its descendants;
        none, or a zero field, sets no limit of its own."""
        if not name:
            raise InvalidArgument("a project needs a name")
        _need_id("parent project", parent)
        body: dict[str, Any] = {"parent": parent, "name": name, "quota": (quota or ProjectQuota()).to_json()}
        if dedicated_nodes:
            body["dedicated_nodes"] = True
        return Project.from_json(await self._call("POST", "/v1/projects", json_body=body))

    async def get_project(self, project_id: str) -> Project:
        """One project; its ``usage`` counts it with all its descendants."""
        _need_id("project", project_id)
        return Project.from_json(await self._call("GET", f"/v1/projects/{esc(project_id)}"))

    async def list_projects(self, parent: Optional[str] = None, *, page_size: Optional[int] = None) -> "list[Project]":
        """The children of ``parent``, or every project the caller can see
        when it is None, following pagination to the end."""
        out: list[Project] = []
        token = ""
        seen: set[str] = set()
        while True:
            q: list[tuple[str, str]] = []
            if parent:
                q.append(("parent", parent))
            if page_size:
                q.append(("limit", str(page_size)))
            if token:
                q.append(("page_token", token))
            doc = await self._call("GET", "/v1/projects", query=q) or {}
            out.extend(Project.from_json(d) for d in doc.get("projects") or [])
            token = doc.get("next_page_token") or ""
            if not token:
                return out
            if token in seen:  # a server repeating itself would loop us forever
                raise ProtocolError(f"server repeated page token {token!r}")
            seen.add(token)

    async def update_project(
        self,
        project_id: str,
        *,
        quota: Optional[ProjectQuota] = None,
        dedicated_nodes: Optional[bool] = None,
    ) -> Project:
        """Change what is given (None leaves it as it is) and return the
        project as it now is. ``quota`` replaces the whole quota: to change
        one limit, start from ``(await get_project(id)).quota``."""
        _need_id("project", project_id)
        body: dict[str, Any] = {}
        if quota is not None:
            body["quota"] = quota.to_json()
        if dedicated_nodes is not None:
            body["dedicated_nodes"] = bool(dedicated_nodes)
        if not body:
            raise InvalidArgument("update_project: nothing to change (give quota or dedicated_nodes)")
        return Project.from_json(await self._call("PATCH", f"/v1/projects/{esc(project_id)}", json_body=body))

    async def delete_project(self, project_id: str, *, cascade: bool = False) -> None:
        """Delete a project; with ``cascade`` the server deletes the
        projects below it too, without it refuses one that has any."""
        _need_id("project", project_id)
        q = [("cascade", "true")] if cascade else None
        await self._call("DELETE", f"/v1/projects/{esc(project_id)}", query=q)

    async def create_key(
        self,
        project_id: str,
        role: str,
        *,
        name: Optional[str] = None,
        expires_in: float = 0,
    ) -> APIKey:
        """Mint an API key of ``project_id`` with ``role`` (no higher than
        the caller's own). The answer's ``key`` is the secret, shown only
        here: keep it now. ``expires_in`` is its lifetime in seconds
        (rounded up; 0: it does not expire)."""
        _need_id("project", project_id)
        if not role:
            raise InvalidArgument("a key needs a role")
        if expires_in < 0:
            raise InvalidArgument("a key's lifetime must not be negative")
        body: dict[str, Any] = {"role": role}
        if name:
            body["name"] = name
        if expires_in:
            body["expires_in"] = math.ceil(expires_in)
        return APIKey.from_json(await self._call("POST", f"/v1/projects/{esc(project_id)}/keys", json_body=body))

    async def list_keys(self, project_id: str) -> "list[APIKey]":
        """The keys of a project, without their secrets."""
        _need_id("project", project_id)
        doc = await self._call("GET", f"/v1/projects/{esc(project_id)}/keys") or {}
        return [APIKey.from_json(d) for d in doc.get("keys") or []]

    async def revoke_key(self, project_id: str, key_id: str) -> None:
        """Revoke a key of a project: calls made with it fail from then on."""
        _need_id("project", project_id)
        _need_id("key", key_id)
        await self._call("DELETE", f"/v1/projects/{esc(project_id)}/keys/{esc(key_id)}")

    async def whoami(self) -> WhoAmI:
        """The caller's key: principal, project, role and permissions."""
        return WhoAmI.from_json(await self._call("GET", "/v1/whoami") or {})

    async def list_audit(self, since: "datetime | str | None" = None, *, limit: int = 0) -> "list[AuditEntry]":
        """The recorded management actions (project and key changes) the
        caller may see, since ``since`` (a datetime, a naive one taken as
        local time, or an RFC 3339 string; None: from the oldest kept), at
        most ``limit`` (0: the server's default). A datetime is sent in UTC
        whole seconds, rounded down, so no entry after it is missed."""
        if limit < 0:
            raise InvalidArgument("limit must not be negative")
        q: list[tuple[str, str]] = []
        if isinstance(since, datetime):
            q.append(("since", since.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")))
        elif since:
            q.append(("since", since))
        if limit:
            q.append(("limit", str(int(limit))))
        doc = await self._call("GET", "/v1/audit", query=q) or {}
        return [AuditEntry.from_json(d) for d in doc.get("entries") or []]


def _check_reached(done: str, count: int, doc: dict, path: str) -> None:
    """Raise NodesUnreachable if a call by labels names nodes it could not
    ask (their sandboxes were left as they are)."""
    nodes = [str(n) for n in doc.get("unreachable_nodes") or []]
    if nodes:
        raise NodesUnreachable(
            f"{done} {count} sandboxes, but {len(nodes)} node(s) could not be asked and their sandboxes"
            f" were left as they are: {', '.join(nodes)} (retry once they are back)",
            count=count,
            nodes=nodes,
            status=200,
            method="POST",
            path=path,
        )


def _need_id(what: str, value: str) -> None:
    """Refuse an empty path segment, which would address the collection
    instead of one of its members."""
    if not value:
        raise InvalidArgument(f"empty {what} id")


async def _read_bounded(resp: _http.Response, limit: int) -> bytes:
    """Read at most ``limit`` bytes of an (error) body, dropping the
    connection if there is more."""
    parts: list[bytes] = []
    n = 0
    while n < limit:
        data = await resp.read_some()
        if not data:
            return b"".join(parts)
        parts.append(data)
        n += len(data)
    resp.close()
    return b"".join(parts)[:limit]

