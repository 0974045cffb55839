"""Measured selection's decisions on disk, so the second compile of a model measures nothing.

One JSON file per target in the tkopt cache (`select-<target>.json`, see tkopt.cache), mapping a key
to what was measured and decided. A key holds everything the measurement depended on: the target's
fingerprint (device, threads, runtime versions), `tkopt.cache.versions()` (an edited kernel is
measured again), `tkopt.cache.selection_sources()` (so is everything, after the code that measures changed),
and the candidate's own key (op, attributes, what it replaced, input dtypes and shape
buckets; or, for a whole graph, its structure and inputs).
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from tkopt.cache import JsonFile, cache_path, selection_sources, versions


class DecisionCache:
    """Decisions of one target on this machine: `get(key)` / `put(key, entry)` (entries are JSON dicts)."""

    def __init__(self, target: str, fingerprint: dict[str, Any]) -> None:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in target)
        self.file = JsonFile(cache_path(f"select-{safe}.json"))
        self.fingerprint = {**fingerprint, **versions(), "selection": selection_sources()}
        self.entries = self.file.read()

    def _full(self, key: Any) -> str:
        return json.dumps([self.fingerprint, key], sort_keys=True, default=str, separators=(",", ":"))

    def get(self, key: Any) -> dict[str, Any] | None:
        return self.entries.get(self._full(key))

    def put(self, key: Any, entry: dict[str, Any]) -> None:
        full = self._full(key)
        self.entries[full] = entry
        try:
            self.file.update(full, entry)
        except OSError as e:  # a read-only cache directory must not break compiling
            warnings.warn(f"tkopt: could not write the decision cache {self.file.path} ({e}); decisions stay in "
                          "memory", stacklevel=2)
