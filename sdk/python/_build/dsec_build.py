"""A minimal PEP 517 build backend for libdsec, standard library only.

Why not setuptools: ``pip install ./sdk/python`` must work on machines with
no package index, and setuptools before 70.1 needs the ``wheel`` package to
build a wheel, which such machines often lack. libdsec is pure Python with no
dependencies, so building it is zipping ``src/libdsec`` with its metadata;
this module does exactly that, and pip needs nothing else
(``requires = []`` in pyproject.toml).

Hooks: build_wheel, build_editable (``pip install -e``: a .pth file pointing
at src/), build_sdist, prepare_metadata_for_build_wheel/editable and the
get_requires_* hooks (none).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tarfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "libdsec"
_WHEEL_TAG = "py3-none-any"


def _project() -> dict:
    """The [project] table of pyproject.toml (simple keys only)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        raw = f.read()
    try:
        import tomllib  # 3.11+

        return tomllib.loads(raw.decode())["project"]
    except ImportError:
        pass
    # Python 3.10: the [project] table's `key = "string"` lines suffice.
    out: dict = {}
    section = ""
    for line in raw.decode().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]").strip()
            continue
        m = re.match(r'^([A-Za-z0-9_-]+)\s*=\s*"([^"]*)"\s*$', line)
        if section == "project" and m:
            out[m.group(1)] = m.group(2)
    return out


def _name_version() -> tuple[str, str]:
    p = _project()
    return p["name"], p["version"]


def _dist_info() -> str:
    name, version = _name_version()
    return f"{name}-{version}.dist-info"


def _metadata() -> str:
    p = _project()
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {p['name']}",
        f"Version: {p['version']}",
    ]
    if p.get("description"):
        lines.append(f"Summary: {p['description']}")
    if p.get("requires-python"):
        lines.append(f"Requires-Python: {p['requires-python']}")
    for c in p.get("classifiers", []) if isinstance(p.get("classifiers"), list) else []:
        lines.append(f"Classifier: {c}")
    readme = os.path.join(ROOT, "README.md")
    body = ""
    if os.path.exists(readme):
        lines.append("Description-Content-Type: text/markdown")
        with open(readme, encoding="utf-8") as f:
            body = f.read()
    return "\n".join(lines) + "\n\n" + body


def _wheel_file() -> str:
    return f"Wheel-Version: 1.0\nGenerator: dsec_build\nRoot-Is-Purelib: true\nTag: {_WHEEL_TAG}\n"


def _package_files() -> list[tuple[str, str]]:
    """(path in the wheel, path on disk) of every file of the package."""
    src = os.path.join(ROOT, "src")
    out = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(src, PACKAGE)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for fn in sorted(filenames):
            if fn.endswith((".pyc", ".pyo")):
                continue
            full = os.path.join(dirpath, fn)
            out.append((os.path.relpath(full, src).replace(os.sep, "/"), full))
    return out


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _write_wheel(wheel_directory: str, files: list[tuple[str, bytes]]) -> str:
    name, version = _name_version()
    di = _dist_info()
    files = files + [
        (f"{di}/METADATA", _metadata().encode()),
        (f"{di}/WHEEL", _wheel_file().encode()),
        (f"{di}/top_level.txt", f"{PACKAGE}\n".encode()),
    ]
    record = "".join(f"{path},{_hash(data)},{len(data)}\n" for path, data in files)
    record += f"{di}/RECORD,,\n"
    files.append((f"{di}/RECORD", record.encode()))
    fname = f"{name}-{version}-{_WHEEL_TAG}.whl"
    os.makedirs(wheel_directory, exist_ok=True)
    # Fixed timestamps keep the wheel reproducible.
    stamp = (2020, 1, 1, 0, 0, 0)
    with zipfile.ZipFile(os.path.join(wheel_directory, fname), "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files:
            zi = zipfile.ZipInfo(path, stamp)
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data)
    return fname


def _prepare_metadata(metadata_directory: str) -> str:
    di = _dist_info()
    d = os.path.join(metadata_directory, di)
    os.makedirs(d, exist_ok=True)
    for fn, text in (("METADATA", _metadata()), ("WHEEL", _wheel_file()), ("top_level.txt", f"{PACKAGE}\n")):
        with open(os.path.join(d, fn), "w", encoding="utf-8") as f:
            f.write(text)
    return di


# -- PEP 517 / 660 hooks --------------------------------------------------


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _prepare_metadata(metadata_directory)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _prepare_metadata(metadata_directory)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    files = []
    for arc, full in _package_files():
        with open(full, "rb") as f:
            files.append((arc, f.read()))
    return _write_wheel(wheel_directory, files)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    pth = os.path.join(ROOT, "src") + "\n"
    return _write_wheel(wheel_directory, [(f"__editable__.{PACKAGE}.pth", pth.encode())])


def build_sdist(sdist_directory, config_settings=None):
    name, version = _name_version()
    base = f"{name}-{version}"
    fname = f"{base}.tar.gz"
    os.makedirs(sdist_directory, exist_ok=True)
    members = []
    for top in ("pyproject.toml", "README.md", "_build", "src", "tests"):
        full = os.path.join(ROOT, top)
        if os.path.isfile(full):
            members.append(top)
        elif os.path.isdir(full):
            for dirpath, dirnames, filenames in os.walk(full):
                dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
                for fn in sorted(filenames):
                    if not fn.endswith((".pyc", ".pyo")):
                        members.append(os.path.relpath(os.path.join(dirpath, fn), ROOT))
    with tarfile.open(os.path.join(sdist_directory, fname), "w:gz", format=tarfile.PAX_FORMAT) as t:
        pkg_info = _metadata().encode()
        ti = tarfile.TarInfo(f"{base}/PKG-INFO")
        ti.size, ti.mtime, ti.mode = len(pkg_info), int(time.time()), 0o644
        t.addfile(ti, io.BytesIO(pkg_info))
        for rel in members:
            t.add(os.path.join(ROOT, rel), arcname=f"{base}/{rel.replace(os.sep, '/')}", recursive=False)
    return fname
