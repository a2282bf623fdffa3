"""The stdlib build backend: `pip install ./sdk/python` must work offline."""

from __future__ import annotations

import hashlib
import base64
import os
import subprocess
import sys
import tarfile
import tempfile
import unittest
import zipfile

import fakeserver  # noqa: F401  (puts the source tree on sys.path)

import libdsec

HERE = os.path.dirname(os.path.abspath(__file__))
PROJECT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(PROJECT, "_build"))

import dsec_build  # noqa: E402


class BuildBackendTest(unittest.TestCase):
    def test_wheel(self):
        with tempfile.TemporaryDirectory() as d:
            name = dsec_build.build_wheel(d)
            self.assertEqual(name, f"libdsec-{libdsec.__version__}-py3-none-any.whl")
            with zipfile.ZipFile(os.path.join(d, name)) as z:
                names = set(z.namelist())
                di = f"libdsec-{libdsec.__version__}.dist-info"
                for want in ("libdsec/__init__.py", "libdsec/sync.py", "libdsec/py.typed", f"{di}/METADATA", f"{di}/WHEEL", f"{di}/RECORD"):
                    self.assertIn(want, names)
                self.assertFalse([n for n in names if "__pycache__" in n])
                meta = z.read(f"{di}/METADATA").decode()
                self.assertIn("Requires-Python: >=3.10", meta)
                # Every file but RECORD itself is recorded with its hash.
                for line in z.read(f"{di}/RECORD").decode().splitlines():
                    path, h, size = line.split(",")
                    if path.endswith("RECORD"):
                        continue
                    data = z.read(path)
                    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                    self.assertEqual((h, int(size)), (f"sha256={digest}", len(data)), path)
                self.assertEqual(len(z.read(f"{di}/RECORD").decode().splitlines()), len(names))

    def test_sdist(self):
        with tempfile.TemporaryDirectory() as d:
            name = dsec_build.build_sdist(d)
            with tarfile.open(os.path.join(d, name)) as t:
                names = t.getnames()
            base = name[: -len(".tar.gz")]
            for want in ("PKG-INFO", "pyproject.toml", "_build/dsec_build.py", "src/libdsec/client.py"):
                self.assertIn(f"{base}/{want}", names)

    @unittest.skipUnless(os.environ.get("LIBDSEC_TEST_PIP", "1") != "0", "LIBDSEC_TEST_PIP=0")
    def test_pip_install_without_index(self):
        try:
            import pip  # noqa: F401
        except ImportError:
            self.skipTest("pip is not installed")
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONPATH="")
            out = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--no-deps", "--target", os.path.join(d, "t"), PROJECT],
                env=env, capture_output=True, text=True, timeout=120,
            )
            self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
            out = subprocess.run(
                [sys.executable, "-c", "import libdsec.sync, sys; print(libdsec.__file__)"],
                env=dict(env, PYTHONPATH=os.path.join(d, "t")), capture_output=True, text=True, timeout=60, cwd=d,
            )
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertTrue(out.stdout.startswith(os.path.join(d, "t")), out.stdout)


if __name__ == "__main__":
    unittest.main()
