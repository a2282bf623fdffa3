"""Typed views of the dsec API's requests and answers.

Field names follow api/openapi.yaml. Answers are parsed leniently: unknown
fields are ignored (the full document stays in ``raw``), missing ones take
their zero value, so a newer server does not break an older SDK.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import InvalidArgument

__all__ = [
    "DSecContainerRunArgs",
    "SandboxInfo",
    "ExecResult",
    "ExecChunk",
    "ExecStatus",
    "FileEntry",
    "TarResult",
    "PauseResult",
    "Stats",
    "Layer",
    "LogEntry",
    "LogPage",
    "Node",
    "ProjectQuota",
    "ProjectUsage",
    "Project",
    "APIKey",
    "WhoAmI",
    "AuditEntry",
]


@dataclass
class DSecContainerRunArgs:
    """What to run: the arguments of ``DSecClient.run_container``.

    Mapped onto the REST ``SandboxSpec`` by :meth:`to_spec`:

    ========================  ==========================================
    field                     SandboxSpec field
    ========================  ==========================================
    ``container_image``       ``base`` (a ``base/name:tag`` ref or digest)
    ``workspace``             ``workspace``
    ``toolkits``              ``toolkits`` (applied in order)
    ``snapshot``              ``snapshot`` (start from a snapshot layer)
    ``memory_limit_mb``       ``memory_mb``
    ``cpu_cores_limit``       ``cpu``
    ``pids_limit``            ``pids``
    ``ttl_running_stop``      ``idle_timeout`` (see below)
    ``ttl``                   ``ttl`` (maximum lifetime)
    ``network_rules``         ``network``: ``{"allow": [names set True],
                              "deny": [names set False]}``
    ``init_user``             ``user``
    ``env`` ``workdir``       ``env`` ``workdir``
    ``labels`` ``qos``        ``labels`` ``qos``
    ``backend``               ``backend``
    ``userns``                ``userns`` (root inside unprivileged on the host;
                              None: the node decides, False: none)
    ``memory_cgroup``         ``memory_cgroup``: ``"own"`` (default) or
                              ``"shared"`` (denser; no ``memory_mb``)
    ``project``               ``project`` (default: the key's own; one
                              below it is allowed)
    ========================  ==========================================

    ``ttl_running_stop`` is the *idle* timeout: the sandbox is stopped after
    that many seconds without a request to it. DSec's own listing comments it
    as "idle timeout", so it maps to ``idle_timeout``, not to the maximum
    lifetime, which is ``ttl`` (0 = the platform default, 3600 s).

    Zero, None and empty values are left out of the spec, so the server's
    defaults apply. ``network_rules`` keys are what the API's allow and deny
    lists take: a preset configured on the edge (``pypi``, ``npm``,
    ``github``, ...), a domain (``files.example.org``, ``*.example.org``) or
    an IPv4 prefix with optional port and protocol (``10.1.2.0/24:443/tcp``).
    A sandbox without allow rules is loopback-only.
    """

    container_image: Optional[str] = None
    workspace: Optional[str] = None
    toolkits: list[str] = field(default_factory=list)
    memory_limit_mb: int = 0
    cpu_cores_limit: float = 0
    ttl_running_stop: int = 0
    ttl: int = 0
    network_rules: dict[str, bool] = field(default_factory=dict)
    init_user: Optional[str] = None
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    workdir: Optional[str] = None
    snapshot: Optional[str] = None
    pids_limit: int = 0
    qos: Optional[str] = None
    backend: Optional[str] = None
    userns: Optional[bool] = None
    memory_cgroup: Optional[str] = None
    project: Optional[str] = None

    def to_spec(self) -> dict[str, Any]:
        """Return the REST ``SandboxSpec`` (a JSON-ready dict)."""
        spec: dict[str, Any] = {}
        if self.backend:
            spec["backend"] = self.backend
        if self.userns is not None:
            spec["userns"] = bool(self.userns)
        if self.container_image:
            spec["base"] = self.container_image
        if self.workspace:
            spec["workspace"] = self.workspace
        if self.toolkits:
            if isinstance(self.toolkits, str):
                raise TypeError("toolkits must be a list of refs, not a string")
            spec["toolkits"] = list(self.toolkits)
        if self.snapshot:
            spec["snapshot"] = self.snapshot
        if self.cpu_cores_limit:
            spec["cpu"] = float(self.cpu_cores_limit)
        if self.memory_limit_mb:
            spec["memory_mb"] = int(self.memory_limit_mb)
        if self.pids_limit:
            spec["pids"] = int(self.pids_limit)
        if self.ttl:
            spec["ttl"] = int(self.ttl)
        if self.ttl_running_stop:
            spec["idle_timeout"] = int(self.ttl_running_stop)
        if self.network_rules:
            allow, deny = [], []
            for name, ok in self.network_rules.items():
                if not isinstance(ok, bool):
                    raise TypeError(f"network_rules[{name!r}] must be True or False, got {ok!r}")
                (allow if ok else deny).append(name)
            net: dict[str, list[str]] = {}
            if allow:
                net["allow"] = allow
            if deny:
                net["deny"] = deny
            spec["network"] = net
        if self.env:
            spec["env"] = dict(self.env)
        if self.init_user:
            spec["user"] = self.init_user
        if self.workdir:
            spec["workdir"] = self.workdir
        if self.labels:
            spec["labels"] = dict(self.labels)
        if self.qos:
            spec["qos"] = self.qos
        if self.memory_cgroup:
            spec["memory_cgroup"] = self.memory_cgroup
        if self.project:
            spec["project"] = self.project
        return spec


def _s(d: dict, k: str) -> str:
    v = d.get(k)
    return "" if v is None else str(v)


def _i(d: dict, k: str) -> int:
    v = d.get(k)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def _b64(v: Any) -> Optional[bytes]:
    if not v:
        return None
    try:
        return base64.b64decode(v)
    except (ValueError, TypeError):
        return None


@dataclass
class SandboxInfo:
    """A sandbox as the server describes it (``Sandbox`` in the API)."""

    id: str
    node: str = ""
    project: str = ""
    backend: str = ""
    state: str = ""
    spec: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    expires_at: str = ""
    last_active_at: str = ""
    paused_at: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    layers: list[str] = field(default_factory=list)
    error: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SandboxInfo":
        return cls(
            id=_s(d, "id"),
            node=_s(d, "node"),
            project=_s(d, "project"),
            backend=_s(d, "backend"),
            state=_s(d, "state"),
            spec=dict(d.get("spec") or {}),
            created_at=_s(d, "created_at"),
            expires_at=_s(d, "expires_at"),
            last_active_at=_s(d, "last_active_at"),
            paused_at=_s(d, "paused_at"),
            labels=dict(d.get("labels") or {}),
            layers=list(d.get("layers") or []),
            error=_s(d, "error"),
            raw=d,
        )


@dataclass
class ExecResult:
    """The result of a command (exec, run_shell, session run).

    A command that exits non-zero or times out is not an exception: look at
    ``exit_code`` and ``timed_out``. ``stdout``/``stderr`` are text (invalid
    UTF-8 replaced); ``stdout_bytes``/``stderr_bytes`` are the exact bytes.
    """

    exit_code: int
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    truncated: bool = False
    duration_ms: int = 0
    stdout_bytes: bytes = field(default=b"", repr=False)
    stderr_bytes: bytes = field(default=b"", repr=False)

    @property
    def ok(self) -> bool:
        """The command exited 0 and did not time out."""
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ExecResult":
        stdout, stderr = _s(d, "stdout"), _s(d, "stderr")
        ob, eb = _b64(d.get("stdout_b64")), _b64(d.get("stderr_b64"))
        return cls(
            exit_code=_i(d, "exit_code"),
            stdout=stdout,
            stderr=stderr,
            timed_out=bool(d.get("timed_out")),
            truncated=bool(d.get("truncated")),
            duration_ms=_i(d, "duration_ms"),
            stdout_bytes=ob if ob is not None else stdout.encode("utf-8", "surrogateescape"),
            stderr_bytes=eb if eb is not None else stderr.encode("utf-8", "surrogateescape"),
        )


@dataclass
class ExecChunk:
    """One piece of output of a streaming exec."""

    stream: str  # "stdout" or "stderr"
    data: bytes

    @property
    def text(self) -> str:
        """The chunk as text (invalid UTF-8 replaced)."""
        return self.data.decode("utf-8", errors="replace")


@dataclass
class ExecStatus:
    """How a streaming exec ended (its final event)."""

    exit_code: int
    timed_out: bool = False
    truncated: bool = False
    duration_ms: int = 0

    @property
    def ok(self) -> bool:
        """The command exited 0 and did not time out."""
        return self.exit_code == 0 and not self.timed_out


@dataclass
class FileEntry:
    """One file, directory or link inside a sandbox."""

    path: str
    type: str = ""  # file | dir | symlink | other
    size: int = 0
    mode: str = ""  # octal string, e.g. "0644"
    mtime: str = ""
    link_target: str = ""

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "FileEntry":
        return cls(
            path=_s(d, "path"),
            type=_s(d, "type"),
            size=_i(d, "size"),
            mode=_s(d, "mode"),
            mtime=_s(d, "mtime"),
            link_target=_s(d, "link_target"),
        )


@dataclass
class TarResult:
    """What a directory upload extracted."""

    files: int = 0
    bytes: int = 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TarResult":
        return cls(files=_i(d, "files"), bytes=_i(d, "bytes"))


@dataclass
class PauseResult:
    """A paused sandbox and the memory reclaiming it freed."""

    sandbox: SandboxInfo
    memory_before_bytes: int = 0
    memory_after_bytes: int = 0
    memory_freed_bytes: int = 0
    reclaim_method: str = ""
    duration_ms: int = 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "PauseResult":
        return cls(
            sandbox=SandboxInfo.from_json(d.get("sandbox") or {}),
            memory_before_bytes=_i(d, "memory_before_bytes"),
            memory_after_bytes=_i(d, "memory_after_bytes"),
            memory_freed_bytes=_i(d, "memory_freed_bytes"),
            reclaim_method=_s(d, "reclaim_method"),
            duration_ms=_i(d, "duration_ms"),
        )


@dataclass
class Stats:
    """A sandbox's resource use at the time of the call."""

    cpu_usage_ns: int = 0
    memory_bytes: int = 0
    memory_limit_bytes: int = 0  # 0 when unlimited
    pids: int = 0
    disk_bytes: int = 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Stats":
        return cls(
            cpu_usage_ns=_i(d, "cpu_usage_ns"),
            memory_bytes=_i(d, "memory_bytes"),
            memory_limit_bytes=_i(d, "memory_limit_bytes"),
            pids=_i(d, "pids"),
            disk_bytes=_i(d, "disk_bytes"),
        )


@dataclass
class Layer:
    """A layer of the catalog (base, workspace, toolkit or snapshot)."""

    digest: str
    ref: str = ""
    kind: str = ""
    size_bytes: int = 0
    created_at: str = ""
    snapshot: Optional[dict[str, Any]] = None  # SnapshotInfo, for snapshots

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Layer":
        return cls(
            digest=_s(d, "digest"),
            ref=_s(d, "ref"),
            kind=_s(d, "kind"),
            size_bytes=_i(d, "size_bytes"),
            created_at=_s(d, "created_at"),
            snapshot=d.get("snapshot"),
        )


@dataclass
class LayerGCResult:
    """What a layer gc removed (with ``dry_run``, what it would remove now):
    blobs no ref named and no sandbox used, and the bytes they held."""

    removed: list[str] = field(default_factory=list)
    removed_bytes: int = 0
    dry_run: bool = False

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LayerGCResult":
        return cls(
            removed=[str(x) for x in d.get("removed") or []],
            removed_bytes=_i(d, "removed_bytes"),
            dry_run=bool(d.get("dry_run", False)),
        )


@dataclass
class LogEntry:
    """One operation of a sandbox's command log."""

    seq: int
    time: str = ""
    kind: str = ""
    request: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LogEntry":
        return cls(
            seq=_i(d, "seq"),
            time=_s(d, "time"),
            kind=_s(d, "kind"),
            request=dict(d.get("request") or {}),
            result=dict(d.get("result") or {}),
        )


@dataclass
class LogPage:
    """One page of a command log; pass ``next_seq`` as ``since_seq`` to read on."""

    entries: list[LogEntry]
    next_seq: int = 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LogPage":
        return cls(entries=[LogEntry.from_json(e) for e in d.get("entries") or []], next_seq=_i(d, "next_seq"))


@dataclass
class Node:
    """An edge as the apiserver sees it."""

    name: str
    healthy: bool = False
    backends: list[str] = field(default_factory=list)
    capacity: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Node":
        return cls(
            name=_s(d, "name"),
            healthy=bool(d.get("healthy")),
            backends=list(d.get("backends") or []),
            capacity=dict(d.get("capacity") or {}),
            counts=dict(d.get("counts") or {}),
            raw=d,
        )


def _f(d: dict, k: str) -> float:
    v = d.get(k)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


@dataclass
class ProjectQuota:
    """A project's limits, for it and all its descendants together. A zero
    field sets no limit of its own: the nearest ancestor's applies."""

    sandboxes: int = 0
    cpu: float = 0.0
    memory_mb: int = 0
    disk_mb: int = 0

    def to_json(self) -> dict[str, Any]:
        """The API's ``ProjectQuota``; every field is sent (zero included)."""
        for name in ("sandboxes", "cpu", "memory_mb", "disk_mb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"ProjectQuota.{name} must be a number, got {v!r}")
            if v < 0:
                raise InvalidArgument(f"quota {name} must not be negative, got {v!r}")
        return {"sandboxes": int(self.sandboxes), "cpu": float(self.cpu), "memory_mb": int(self.memory_mb), "disk_mb": int(self.disk_mb)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ProjectQuota":
        return cls(sandboxes=_i(d, "sandboxes"), cpu=_f(d, "cpu"), memory_mb=_i(d, "memory_mb"), disk_mb=_i(d, "disk_mb"))


@dataclass
class ProjectUsage:
    """What a project and all its descendants hold now: live sandboxes
    (creating, running, paused) and what their specs ask for."""

    sandboxes: int = 0
    cpu: float = 0.0
    memory_mb: int = 0
    disk_mb: int = 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ProjectUsage":
        return cls(sandboxes=_i(d, "sandboxes"), cpu=_f(d, "cpu"), memory_mb=_i(d, "memory_mb"), disk_mb=_i(d, "disk_mb"))


@dataclass
class Project:
    """A node of the project tree. ``path`` is its lineage from the root
    (``root/team-a/job-7``); ``usage`` counts it with its descendants."""

    id: str
    name: str = ""
    parent: str = ""
    path: str = ""
    quota: ProjectQuota = field(default_factory=ProjectQuota)
    usage: ProjectUsage = field(default_factory=ProjectUsage)
    children: list[str] = field(default_factory=list)
    dedicated_nodes: bool = False
    created_at: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Project":
        return cls(
            id=_s(d, "id"),
            name=_s(d, "name"),
            parent=_s(d, "parent"),
            path=_s(d, "path"),
            quota=ProjectQuota.from_json(d.get("quota") or {}),
            usage=ProjectUsage.from_json(d.get("usage") or {}),
            children=list(d.get("children") or []),
            dedicated_nodes=bool(d.get("dedicated_nodes")),
            created_at=_s(d, "created_at"),
            raw=d,
        )


@dataclass
class APIKey:
    """An API key of a project. ``key``, the secret, is set only in the
    answer to ``create_key``: the server keeps its hash and never shows it
    again. ``expires_at`` is empty for a key that does not expire."""

    id: str
    project: str = ""
    role: str = ""
    name: str = ""
    key: str = field(default="", repr=False)
    created_at: str = ""
    expires_at: str = ""

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "APIKey":
        return cls(
            id=_s(d, "id"),
            project=_s(d, "project"),
            role=_s(d, "role"),
            name=_s(d, "name"),
            key=_s(d, "key"),
            created_at=_s(d, "created_at"),
            expires_at=_s(d, "expires_at"),
        )


@dataclass
class WhoAmI:
    """The caller's key: its principal, project, role and what the role
    permits."""

    principal: str = ""
    project: str = ""
    role: str = ""
    permissions: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "WhoAmI":
        return cls(principal=_s(d, "principal"), project=_s(d, "project"), role=_s(d, "role"), permissions=list(d.get("permissions") or []))


@dataclass
class AuditEntry:
    """One recorded management action (a project or key change)."""

    time: str = ""
    principal: str = ""
    project: str = ""
    action: str = ""
    target: str = ""
    detail: str = ""

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "AuditEntry":
        return cls(
            time=_s(d, "time"),
            principal=_s(d, "principal"),
            project=_s(d, "project"),
            action=_s(d, "action"),
            target=_s(d, "target"),
            detail=_s(d, "detail"),
        )
