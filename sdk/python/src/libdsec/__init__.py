"""libdsec: the Python SDK of dsec, the sandbox platform for agentic RL.

Async first (asyncio); ``libdsec.sync`` has a blocking facade. Standard
library only. Typical use::

    from libdsec import DSecClient, DSecContainerRunArgs

    client = DSecClient()                  # DSEC_ENDPOINT / DSEC_API_KEY / config file
    await client.open()
    args = DSecContainerRunArgs(container_image="base/python:3.11",
                                memory_limit_mb=4096, cpu_cores_limit=4,
                                ttl_running_stop=300, labels={"job": "grpo-1"})
    async with client.run_container(args, timeout=120) as sandbox:
        result = await sandbox.run_shell("echo hello world")
        print(result.exit_code, result.stdout)
    await client.close()

See docs/python-sdk.md in the dsec repository for the guide.
"""

from .client import BatchResult, DSecClient, idempotency_key
from .config import DEFAULT_ENDPOINT, Config, resolve_config
from .errors import (
    AlreadyExists,
    BatchFailed,
    CapacityExhausted,
    ConfigError,
    ConnectionFailed,
    DeadlineExceeded,
    DSecError,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NodesUnreachable,
    NotFound,
    PermissionDenied,
    ProtocolError,
    QuotaExceeded,
    SandboxNotFound,
    Unauthenticated,
    Unavailable,
    UnsafeArchive,
)
from .sandbox import Command, ExecStream, Sandbox, Session
from .terminal import Terminal
from .types import (
    APIKey,
    AuditEntry,
    DSecContainerRunArgs,
    ExecChunk,
    ExecResult,
    ExecStatus,
    FileEntry,
    Layer,
    LayerGCResult,
    LogEntry,
    LogPage,
    Node,
    PauseResult,
    Project,
    ProjectQuota,
    ProjectUsage,
    SandboxInfo,
    Stats,
    TarResult,
    WhoAmI,
)

__version__ = "0.1.0"

__all__ = [
    "DSecClient",
    "idempotency_key",
    "DSecContainerRunArgs",
    "Sandbox",
    "Session",
    "ExecStream",
    "Terminal",
    "Command",
    "BatchResult",
    "SandboxInfo",
    "ExecResult",
    "ExecChunk",
    "ExecStatus",
    "FileEntry",
    "TarResult",
    "PauseResult",
    "Stats",
    "Layer",
    "LayerGCResult",
    "LogEntry",
    "LogPage",
    "Node",
    "Project",
    "ProjectQuota",
    "ProjectUsage",
    "APIKey",
    "WhoAmI",
    "AuditEntry",
    "Config",
    "DEFAULT_ENDPOINT",
    "resolve_config",
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
]
