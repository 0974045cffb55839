"""Files tkopt writes for the user: checked before any work, written all or nothing, with the user's umask.

Temporary files (tempfile.mkstemp, onnx's external-data writer) are created 0600; renamed into place they
would keep that mode, so every output gets the mode a plain `open()` would have given it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from pathlib import Path

_UMASK_LOCK = threading.Lock()


def umask() -> int:
    """The process umask (reading it means setting it: done under a lock and restored at once)."""
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def chmod_default(path: str | Path, executable: bool = False) -> None:
    """Give `path` the mode a new file gets from the user's umask (0o777 for a shared library, as a linker does)."""
    os.chmod(path, (0o777 if executable else 0o666) & ~umask())


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` all or nothing (a temporary file beside it, then os.replace), umask mode."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        chmod_default(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def check_output(path: str | Path, what: str = "output", source: str | Path | None = None,
                 force: bool = False) -> Path:
    """Refuse an output path before any work is done, with one line saying why.

    A directory, a path under a file, a folder tkopt cannot create a file in, or (unless `force`) the
    input `source` itself. The folder is probed by creating and removing a file in it: the only answer
    that holds for read-only mounts and for root alike. Missing folders are fine if they can be made.
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {path} is a directory; give a file name")
    if source is not None and not force and _same_file(p, Path(source)):
        raise ValueError(f"{what} {path} is the input model; pass --force to overwrite it")
    folder = p.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{what} {path}: {folder} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".tkopt-probe-", dir=folder)
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot write in {folder}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)
    return p


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()
