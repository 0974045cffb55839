"""tkopt's on-disk caches: where they live, what invalidates them, and safe writes.

Everything lives under `cache_dir()` (TKOPT_CACHE_DIR, default ~/.cache/tkopt; the kernels' tuning
cache is there too): measured-selection decisions (`select-<target>.json`), lowered ORT kernels and
their compiled objects (`ort-kernels/`), ORT's headers. An entry is only valid for the `versions()`
it was made with: tkopt's and TileLang's versions and a hash of the kernel and fused-op sources, so
editing a kernel invalidates what was measured or compiled from it; decisions also carry a hash of the
sources that measure them (`selection_sources()`). Writes are atomic (a temporary
file, then os.replace), and JSON files merge concurrent writers under a file lock.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from tkopt.kernels.libraries import installed_version, sources_digest
from tkopt.kernels.tuning import cache_dir, read_json, store_json


def cache_path(*parts: str) -> Path:
    return Path(cache_dir(), *parts)


@functools.cache
def versions() -> dict[str, str]:
    """tkopt's and TileLang's versions, and a hash of the sources that decide what a kernel is."""
    import tkopt.fused_ops
    import tkopt.kernels

    sources = sources_digest(*(Path(pkg.__file__).parent for pkg in (tkopt.kernels, tkopt.fused_ops)))
    return {"tkopt": installed_version("tkopt"), "tilelang": installed_version("tilelang"), "sources": sources}


@functools.cache
def selection_sources() -> str:
    """A hash of the sources that measure and decide fusions (the targets, the pipeline, the timing): a decision
    measured by other code, say against a baseline run another way, is measured again."""
    import tkopt.targets

    return sources_digest(Path(tkopt.targets.__file__).parent, Path(__file__).parent)


def digest(*parts: Any) -> str:
    """A short stable hash of JSON-able parts (with versions() mixed in by the caller where it matters)."""
    text = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class JsonFile:
    """A JSON object on disk shared by processes: `read()`, and `update(key, value)` merged under a lock (the
    kernels' tuning-cache writer, so every cache file is written one way)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[str, Any]:
        return read_json(str(self.path))

    def update(self, key: str, value: Any) -> None:
        store_json(str(self.path), key, value)
