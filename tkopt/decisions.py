"""Measured selection's decisions on disk, so the second compile of a model measures nothing.

One JSON file per target in the tkopt cache (`select-<target>.json`, see tkopt.cache), mapping a key
to what was measured and decided. A key holds everything the measurement depended on: the target's
fingerprint (device, threads, runtime versions), `tkopt.cache.versions()` (an edited kernel is
measured again), `tkopt.cache.selection_sources()` (so is everything, after the code that measures changed),
and the candidate's own key (op, attributes, what it replaced, input dtypes and shape
buckets; or, for a whole graph, its structure and inputs).

Shipped declines (SHIPPED_DIR, written by benchmarks/ship_decisions.py from the benchmark models' runs): where this
machine has no decision, a node the same target fingerprint (device, runtime versions) declined on our benchmark
machines is declined here without building its kernel, which is most of a cold compile on a small model. Only
declines ship: one runs what the user's model runs anyway, so a stale one (a kernel made faster since) costs speed,
never correctness; the keys leave out tkopt's versions for that reason. TKOPT_SHIPPED_DECISIONS=0 ignores them.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Any

from tkopt.cache import JsonFile, cache_path, selection_sources, versions
from tkopt.kernels.tuning import env_enabled, read_json, safe_name

SHIPPED_DIR = Path(__file__).resolve().parent / "selected"


def file_name(target: str) -> str:
    """`target`'s decisions file, in the cache and in SHIPPED_DIR."""
    return f"select-{safe_name(target)}.json"


def _key(fingerprint: dict[str, Any], key: Any) -> str:
    return json.dumps([fingerprint, key], sort_keys=True, default=str, separators=(",", ":"))


@functools.cache
def _shipped(name: str) -> dict[str, Any]:
    return read_json(str(SHIPPED_DIR / name))


class DecisionCache:
    """Decisions of one target on this machine: `get(key)` / `put(key, entry)` (entries are JSON dicts); `get`
    falls back to the shipped declines (module docstring), whose entries name where they were measured
    ("shipped")."""

    def __init__(self, target: str, fingerprint: dict[str, Any]) -> None:
        self.file = JsonFile(cache_path(file_name(target)))
        self.target_fingerprint = fingerprint
        self.fingerprint = {**fingerprint, **versions(), "selection": selection_sources()}
        self.entries = self.file.read()
        self.shipped = _shipped(file_name(target)) if env_enabled("TKOPT_SHIPPED_DECISIONS") else {}

    def get(self, key: Any) -> dict[str, Any] | None:
        entry = self.entries.get(_key(self.fingerprint, key))
        return entry if entry is not None else self.shipped.get(_key(self.target_fingerprint, key))

    def put(self, key: Any, entry: dict[str, Any]) -> None:
        full = _key(self.fingerprint, key)
        self.entries[full] = entry
        try:
            self.file.update(full, entry)
        except OSError as e:  # a read-only cache directory must not break compiling
            warnings.warn(f"tkopt: could not write the decision cache {self.file.path} ({e}); decisions stay in "
                          "memory", stacklevel=2)


def shippable(cache_file: Path, measured_on: str) -> dict[str, Any]:
    """The declines of a decisions file (a run's `select-<target>.json`) as shipped entries: keyed by the target's
    fingerprint without tkopt's versions, each naming `measured_on` (device and date) as "shipped". Kept nodes,
    failed kernels and whole-graph races are left out."""
    dropped = {*versions(), "selection"}
    out: dict[str, Any] = {}
    for full, entry in json.loads(cache_file.read_text()).items():
        fingerprint, key = json.loads(full)
        is_node = isinstance(key, list) and bool(key) and isinstance(key[0], str)
        if is_node and not entry.get("kept") and entry.get("error") is None and entry.get("sizes"):
            kept_fp = {k: v for k, v in fingerprint.items() if k not in dropped}
            out[_key(kept_fp, key)] = {**entry, "shipped": measured_on}
    return out
