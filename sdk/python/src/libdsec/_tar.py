"""Tar packing and safe unpacking for upload_dir / download_dir.

Both run in the event loop's default executor: building or extracting a
large tree is blocking disk work that must not stall other coroutines.
"""

from __future__ import annotations

import os
import tarfile
import tempfile
from typing import IO

from .errors import UnsafeArchive

# Archives up to this size stay in memory; larger ones spill to a temp file.
SPOOL_BYTES = 32 << 20


def pack_dir(local_dir: str) -> IO[bytes]:
    """Pack the contents of ``local_dir`` (not the directory itself) into a
    tar in a spooled temp file, positioned at its start.

    Ownership is reset to root (uid 0), the sandbox's default user: local
    uids mean nothing inside the sandbox.
    """
    if not os.path.isdir(local_dir):
        raise NotADirectoryError(local_dir)

    def reset_owner(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = "root"
        return ti

    f = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
    try:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name in sorted(os.listdir(local_dir)):
                tar.add(os.path.join(local_dir, name), arcname=name, recursive=True, filter=reset_owner)
        f.seek(0)
        return f  # type: ignore[return-value]
    except BaseException:
        f.close()
        raise


def _inside(root: str, path: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def check_members(tar: tarfile.TarFile, dest: str) -> list[tarfile.TarInfo]:
    """Return the members to extract into ``dest``, or raise UnsafeArchive.

    Refused (the whole archive): absolute names, names or hard links that
    resolve outside ``dest`` (``..``, or through a symlink already on disk),
    and symlinks whose target resolves outside ``dest``. Skipped: device
    files and FIFOs, which an unprivileged extraction cannot create and a
    download has no use for. The check runs over every member before
    anything is written.
    """
    root = os.path.realpath(dest)
    data_filter = getattr(tarfile, "data_filter", None)  # 3.10.12+, 3.11.4+
    keep = []
    for m in tar.getmembers():
        name = m.name
        if name.startswith("/") or os.path.isabs(name):
            raise UnsafeArchive(f"archive entry {name!r} has an absolute path")
        target = os.path.realpath(os.path.join(root, name))
        if not _inside(root, target):
            raise UnsafeArchive(f"archive entry {name!r} would land outside {dest}")
        if m.issym():
            if os.path.isabs(m.linkname):
                raise UnsafeArchive(f"archive entry {name!r} is a symlink to an absolute path ({m.linkname!r})")
            link = os.path.realpath(os.path.join(os.path.dirname(target), m.linkname))
            if not _inside(root, link):
                raise UnsafeArchive(f"archive entry {name!r} is a symlink leading outside {dest} ({m.linkname!r})")
        elif m.islnk():
            link = os.path.realpath(os.path.join(root, m.linkname))
            if not _inside(root, link):
                raise UnsafeArchive(f"archive entry {name!r} is a hard link to {m.linkname!r}, outside {dest}")
        elif m.isdev():
            continue
        if data_filter is not None:
            try:
                data_filter(m, root)
            except tarfile.TarError as e:
                raise UnsafeArchive(f"archive entry {name!r}: {e}") from None
        keep.append(m)
    return keep


def unpack(f: IO[bytes], dest: str) -> list[str]:
    """Check, then extract the tar in ``f`` into ``dest`` (created if
    missing). Returns the names extracted."""
    os.makedirs(dest, exist_ok=True)
    f.seek(0)
    with tarfile.open(fileobj=f, mode="r:*") as tar:
        members = check_members(tar, dest)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:
            tar.extractall(dest, members=members)
    return [m.name for m in members]
