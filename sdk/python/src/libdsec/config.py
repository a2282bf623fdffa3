"""Where the client finds its endpoint and API key.

The same rules as the Go SDK and the CLI: ``DSEC_ENDPOINT`` and
``DSEC_API_KEY`` win over the config file (``$DSEC_CONFIG`` or
``~/.config/dsec/config.json``, which ``dsec up`` writes), which wins over
the default endpoint ``http://127.0.0.1:7070``. A missing default config file
is not an error; a missing file named by ``DSEC_CONFIG`` is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

from .errors import ConfigError

__all__ = [
    "DEFAULT_ENDPOINT",
    "ENV_ENDPOINT",
    "ENV_API_KEY",
    "ENV_CONFIG",
    "Config",
    "default_config_path",
    "load_config",
    "resolve_config",
    "normalize_endpoint",
    "normalize_endpoints",
]

#: Used when neither arguments, environment nor config file name an endpoint.
DEFAULT_ENDPOINT = "http://127.0.0.1:7070"
ENV_ENDPOINT = "DSEC_ENDPOINT"
ENV_API_KEY = "DSEC_API_KEY"
ENV_CONFIG = "DSEC_CONFIG"


@dataclass
class Config:
    """The effective endpoint and API key."""

    endpoint: str = ""
    api_key: str = ""


def default_config_path() -> Path:
    """Return ``$DSEC_CONFIG``, or ``~/.config/dsec/config.json``.

    The path is spelled out rather than taken from XDG settings so that every
    SDK and ``dsec up`` agree on it.
    """
    p = os.environ.get(ENV_CONFIG)
    if p:
        return Path(p)
    return Path.home() / ".config" / "dsec" / "config.json"


def load_config(path: "os.PathLike[str] | str") -> Config:
    """Read a config file (``{"endpoint": ..., "api_key": ...}``).

    Raises FileNotFoundError for a missing file and ConfigError for one that
    is not valid JSON.
    """
    with open(path, "rb") as f:
        raw = f.read()
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"parsing config {path}: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"parsing config {path}: not a JSON object")
    return Config(endpoint=str(doc.get("endpoint") or ""), api_key=str(doc.get("api_key") or ""))


def resolve_config(endpoint: Optional[str] = None, api_key: Optional[str] = None) -> Config:
    """Return the effective config.

    Explicit arguments win over the environment, which wins over the config
    file, which wins over :data:`DEFAULT_ENDPOINT`. The file is not read when
    both arguments are given.
    """
    cfg = Config()
    if not (endpoint and api_key is not None):
        try:
            cfg = load_config(default_config_path())
        except FileNotFoundError:
            if os.environ.get(ENV_CONFIG):
                raise ConfigError(f"reading config: {os.environ[ENV_CONFIG]} (named by {ENV_CONFIG}) does not exist") from None
        except RuntimeError:
            pass  # no home directory: the environment must say everything
        except OSError as e:
            raise ConfigError(f"reading config: {e}") from None
    if os.environ.get(ENV_ENDPOINT):
        cfg.endpoint = os.environ[ENV_ENDPOINT]
    if os.environ.get(ENV_API_KEY):
        cfg.api_key = os.environ[ENV_API_KEY]
    if endpoint:
        cfg.endpoint = endpoint
    if api_key is not None:
        cfg.api_key = api_key
    cfg.endpoint = ",".join(normalize_endpoints(cfg.endpoint or DEFAULT_ENDPOINT))
    return cfg


def normalize_endpoints(s: str) -> list[str]:
    """Check and normalize a comma-separated list of base URLs (the
    apiservers of a cluster, to fail over between)."""
    parts = [p for p in s.split(",") if p.strip()] if "," in s else [s]
    if not parts:
        raise ConfigError("empty endpoint")
    return [normalize_endpoint(p) for p in parts]


def normalize_endpoint(s: str) -> str:
    """Check and normalize a base URL: ``host:port`` is taken as http, the
    scheme must be http or https, a trailing slash is dropped."""
    s = s.strip()
    if not s:
        raise ConfigError("empty endpoint")
    if "://" not in s:
        s = "http://" + s
    u = urlsplit(s)
    if u.scheme not in ("http", "https"):
        raise ConfigError(f"endpoint {s!r}: scheme must be http or https")
    if not u.hostname:
        raise ConfigError(f"endpoint {s!r} has no host")
    if u.query or u.fragment:
        raise ConfigError(f"endpoint {s!r} must not have a query or fragment")
    try:
        u.port
    except ValueError:
        raise ConfigError(f"endpoint {s!r} has a bad port") from None
    return s.rstrip("/")
