"""Unit tests of config resolution (the same rules as the Go SDK)."""

from __future__ import annotations

import json
import os
import tempfile
import unittest
from unittest import mock

import fakeserver  # noqa: F401  (puts the source tree on sys.path)

import libdsec
from libdsec.config import normalize_endpoint, resolve_config


class ConfigTest(unittest.TestCase):
    def setUp(self) -> None:
        self.home = tempfile.TemporaryDirectory()
        self.addCleanup(self.home.cleanup)
        self.env = mock.patch.dict(os.environ, {"HOME": self.home.name}, clear=True)
        self.env.start()
        self.addCleanup(self.env.stop)

    def write_cfg(self, path: str, doc: dict) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f)

    def test_default(self):
        cfg = resolve_config()
        self.assertEqual((cfg.endpoint, cfg.api_key), ("http://127.0.0.1:7070", ""))

    def test_file_then_env_then_args(self):
        self.write_cfg(os.path.join(self.home.name, ".config", "dsec", "config.json"), {"endpoint": "http://file:1", "api_key": "fk"})
        self.assertEqual(resolve_config(), libdsec.Config("http://file:1", "fk"))
        os.environ["DSEC_API_KEY"] = "ek"
        self.assertEqual(resolve_config(), libdsec.Config("http://file:1", "ek"))
        os.environ["DSEC_ENDPOINT"] = "env:2"
        self.assertEqual(resolve_config(), libdsec.Config("http://env:2", "ek"))
        self.assertEqual(resolve_config("https://arg:3/", "ak"), libdsec.Config("https://arg:3", "ak"))
        c = libdsec.DSecClient()
        self.assertEqual(c.endpoint, "http://env:2")

    def test_dsec_config(self):
        p = os.path.join(self.home.name, "other.json")
        os.environ["DSEC_CONFIG"] = p
        with self.assertRaises(libdsec.ConfigError):
            resolve_config()  # named but missing: an error
        self.write_cfg(p, {"endpoint": "10.0.0.1:7070", "api_key": "k2"})
        self.assertEqual(resolve_config(), libdsec.Config("http://10.0.0.1:7070", "k2"))
        with open(p, "w") as f:
            f.write("{not json")
        with self.assertRaises(libdsec.ConfigError):
            resolve_config()
        # Explicit endpoint and key need no file at all.
        self.assertEqual(resolve_config("h:1", "k"), libdsec.Config("http://h:1", "k"))

    def test_normalize(self):
        self.assertEqual(normalize_endpoint(" localhost:7070/ "), "http://localhost:7070")
        self.assertEqual(normalize_endpoint("http://[::1]:7070/api/"), "http://[::1]:7070/api")
        for bad in ("", "ftp://x", "http://", "http://h:1?x=1", "http://h:port"):
            with self.assertRaises(libdsec.ConfigError, msg=bad):
                normalize_endpoint(bad)


if __name__ == "__main__":
    unittest.main()
