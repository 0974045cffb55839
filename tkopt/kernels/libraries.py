"""GPU kernels compiled in an earlier process, loaded from their libraries without importing TileLang.

A warm compile imported TileLang (about 900 modules: 0.7-1.4 s) and rebuilt each kernel's program with its DSL,
to print it and find its entry in TileLang's disk cache (0.5-1.1 s for the attention kernel; BERT-base warm
profile, H200, 2026-12-06), only to load a shared library that TVM-FFI can load and call by itself. So every
GPU kernel TileLang compiles for tkopt is recorded in `kernel-libraries.json` (in the tuning cache's folder) by
what asked for it: the program's identity (the kernel function and its compile key), the target and pass
configs, TileLang's version and the kernel sources' digest. A later process finds the library there, loads TVM's
runtime library and TileLang's (their static initializers register what the library calls: the CUDA module
loader, TMA descriptor creation) and `tvm_ffi.load_module`s it. A call is TileLang's adapter's own
(`module(*args)`, the stream taken from torch by TVM-FFI): every tkopt GPU kernel takes its outputs as arguments,
so the adapter's output allocation never applied. An entry whose library is gone, or fails to load, is
compiled through TileLang again.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .tuning import cache_dir, read_json, store_json

log = logging.getLogger(__name__)

INDEX = "kernel-libraries.json"


def gpu_compile(ident: tuple, program: Callable[[], Any], target: dict | str, pass_configs: dict) -> Any:
    """The kernel `program()` builds, compiled by TileLang for `target` with `pass_configs`: loaded from its library
    where a process on this machine compiled it before (`ident` names the program: its builder and arguments;
    equal idents must build equal programs), else compiled now and recorded. Callable as `kernel(*args)`; the
    callers keep it in their in-process caches."""
    key = _key(ident, target, pass_configs)
    compile_now = functools.partial(_compile, key, program, target, pass_configs)
    return _load(key, compile_now) or compile_now()


class Library:
    """A kernel's library loaded through TVM-FFI, called as TileLang's adapter calls it. Should its first call fail
    (a function the library needs is not registered in this install), TileLang's kernel takes over, with a
    warning."""

    def __init__(self, path: str, fallback: Callable[[], Any]) -> None:
        self.path = path
        self.module = _tvm_ffi().load_module(path)
        self._fallback = fallback
        self._call: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> None:
        if self._call is not None:
            self._call(*args)
            return
        try:
            self.module(*args)
            self._call = self.module
        except Exception as e:  # noqa: BLE001 - TileLang's own kernel is the same program
            warnings.warn(f"tkopt: kernel library {self.path} failed to run ({type(e).__name__}: {e}); running "
                          "TileLang's kernel instead", stacklevel=2)
            self._call = self._fallback()
            self._call(*args)


def _load(key: str, fallback: Callable[[], Any]) -> Library | None:
    path = read_json(_index()).get(key)
    if not isinstance(path, str) or not os.path.isfile(path):
        return None
    try:
        return Library(path, fallback)
    except Exception as e:  # noqa: BLE001 - TileLang compiles (or loads) it again
        log.info("tkopt: kernel library %s did not load (%s: %s); compiling through TileLang", path,
                 type(e).__name__, e)
        return None


def _compile(key: str, program: Callable[[], Any], target: dict | str, pass_configs: dict) -> Any:
    import tilelang

    kernel = tilelang.compile(program(), target=target, pass_configs=pass_configs)
    # TileLang tags a kernel with its disk cache entry (content-addressed, kept), whether it compiled or loaded it;
    # untagged (its cache off), nothing is recorded.
    entry = getattr(kernel, "_tilelang_cache_path", None)
    path = os.path.join(entry, "executable.so") if isinstance(entry, str) else None
    if kernel.execution_backend == "tvm_ffi" and path is not None and os.path.isfile(path):
        try:
            store_json(_index(), key, path)
        except OSError:  # a read-only cache: TileLang loads it next time, nothing worse
            pass
    return kernel


def _index() -> str:
    return os.path.join(cache_dir(), INDEX)


def _key(ident: tuple, target: dict | str, pass_configs: dict) -> str:
    text = json.dumps([ident, target, pass_configs, _versions()], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@functools.cache
def installed_version(package: str) -> str:
    """An installed package's version, read without importing it; "unknown" for one run from a source tree or
    PYTHONPATH (the GPU session's tkopt and TileLang)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def sources_digest(*folders: Path) -> str:
    """A short digest of the Python sources in `folders` (names and contents, in order): an edited source changes
    it, so what was compiled or measured from the old one is not reused."""
    h = hashlib.sha256()
    for folder in folders:
        for path in sorted(folder.glob("*.py")):
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def _versions() -> tuple[str, str]:
    """TileLang's version and a digest of the kernels' sources: a changed program or compiler is compiled anew."""
    return installed_version("tilelang"), sources_digest(Path(__file__).parent)


@functools.cache
def _tvm_ffi() -> Any:
    """tvm_ffi, with TVM's runtime library and TileLang's loaded into the process (RTLD_GLOBAL, as TileLang's import
    loads them): the kernels' libraries call functions they register."""
    import tvm_ffi

    spec = importlib.util.find_spec("tilelang")
    if spec is None or spec.origin is None:
        raise ImportError("TileLang is not installed")
    lib = Path(spec.origin).parent / "lib"
    for name in ("libtvm_runtime.so", "libtilelang.so"):
        ctypes.CDLL(str(lib / name), mode=ctypes.RTLD_GLOBAL)
    return tvm_ffi
