"""Autotuning and its on-disk cache, shared by every kernel.

`pick_config(kernel, arch, key, candidates, default, bench)` returns the config (a dict of compile-time
knobs) to use for one (kernel, arch, key):

1. the winner cached in memory or in `cache_dir()/tune-<kernel>-<arch>.json`, else the one shipped with the
   package (`tkopt/kernels/tuned/`, the same format: winners measured on our GPUs at the benchmark models' shapes,
   written by benchmarks/tuning_db.py), so a user gets tuned kernels without tuning and a cold compile
   builds one config per kernel instead of every candidate. Either only if that winner is still one of
   `candidates` or `default`, so a changed search space re-tunes instead of using a stale entry;
2. else, when `tuning_enabled(arch)`, it times every candidate with `bench(config) -> ms` (an exception,
   NaN or inf marks a failed candidate), shows progress, stores the fastest atomically (merge under a
   file lock, write a temp file, `os.replace`; safe across processes) and returns it;
3. else, inside a `suspended()` block where it would otherwise tune, the first candidate: one of the configs
   the tuning will compile anyway, so a build ahead of the calls (`planned_configs`) need not compile the
   default for a probe alone;
4. else `default` (heuristic), without touching the disk.

Environment: TKOPT_CACHE_DIR (default ~/.cache/tkopt); TKOPT_AUTOTUNE: "0"/"false"/"off" disables
tuning; unset or anything else enables it for GPU archs; it is never on for "cpu". TKOPT_SHIPPED_TUNING:
"0"/"false"/"off" ignores the shipped winners (benchmarks/tuning_db.py measures afresh with it). In-process,
`suspended()` turns it off for a block (kernel builds and probes: tuning belongs at the real shapes), and
kernels then keep the config they return out of their per-process config memos.

Keys are JSON-encoded (tuples become lists), so use plain ints / strs / bools / floats in them;
`shape_bucket(n)` rounds a dynamic size (e.g. M) up to a power of two to keep keys few.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

_LOCK = threading.Lock()
_MEMORY: dict[tuple[str, str, str, str], dict] = {}
_SUSPENDED = contextvars.ContextVar("tkopt_tuning_suspended", default=False)


def env_enabled(name: str) -> bool:
    """A switch that is on unless the environment sets it to "0", "false", "off" or "no"."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> str:
    """Directory of the tuning cache files: $TKOPT_CACHE_DIR or ~/.cache/tkopt."""
    return os.environ.get("TKOPT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tkopt")


@contextlib.contextmanager
def suspended():
    """No tuning inside the block (this thread): pick_config returns cached winners or defaults, and kernels
    do not memoize those defaults (`tuning_suspended`), so a later call at real shapes still tunes."""
    token = _SUSPENDED.set(True)
    try:
        yield
    finally:
        _SUSPENDED.reset(token)


def tuning_suspended() -> bool:
    """Whether a `suspended()` block is active: a config picked now may not be the one calls will use."""
    return _SUSPENDED.get()


def tuning_enabled(arch: str | None = None) -> bool:
    """Whether pick_config may benchmark: never for cpu nor in a `suspended()` block; off when TKOPT_AUTOTUNE
    is 0/false/off."""
    return not _SUSPENDED.get() and _tunes(arch)


def _tunes(arch: str | None) -> bool:
    """Whether calls on `arch` tune outside `suspended()` blocks (what a build ahead of them plans for)."""
    return arch != "cpu" and env_enabled("TKOPT_AUTOTUNE")


def shape_bucket(n: int, cap: int = 1 << 16) -> int:
    """n rounded up to a power of two (at least 1), capped at `cap`: a cache-key bucket for a dynamic size."""
    n = int(n)
    if n <= 1:
        return 1
    return min(1 << (n - 1).bit_length(), cap)


SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")


def safe_name(text: str) -> str:
    """`text` as a portable file name part: anything but letters, digits and -_. becomes _."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def file_name(kernel: str, arch: str) -> str:
    """The name of (kernel, arch)'s winners file, in the cache and in SHIPPED_DIR."""
    return f"tune-{safe_name(f'{kernel}-{arch}')}.json"


def _file(kernel: str, arch: str) -> str:
    return os.path.join(cache_dir(), file_name(kernel, arch))


@functools.cache
def _shipped_file(kernel: str, arch: str) -> dict:
    return read_json(os.path.join(SHIPPED_DIR, file_name(kernel, arch)))


def _entry(kernel: str, arch: str, kstr: str) -> dict | None:
    """The stored record for a key: this machine's cache first, else the shipped winners (module docstring)."""
    entry = read_json(_file(kernel, arch)).get(kstr)
    if entry is None and env_enabled("TKOPT_SHIPPED_TUNING"):
        entry = _shipped_file(kernel, arch).get(kstr)
    return entry


def _key_str(key: tuple) -> str:
    return json.dumps(list(key) if isinstance(key, (tuple, list)) else [key], sort_keys=True, default=str)


def _norm(cfg: dict) -> dict:
    """A config as it round-trips through JSON (tuples become lists), for comparisons."""
    return json.loads(json.dumps(cfg, sort_keys=True, default=str))


def read_json(path: str) -> dict:
    """The JSON object at `path`; {} where there is none (or it is not an object)."""
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def _file_lock(path: str):
    """An exclusive advisory lock on `path + '.lock'` (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path + ".lock", "a+") as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lf, fcntl.LOCK_UN)


def store_json(path: str, key: str, value: object) -> None:
    """Set `key` in the JSON object at `path`, merged under a file lock with what other processes wrote meanwhile,
    written to a temporary file and renamed over it (readers never see half a file)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with _file_lock(path):
        data = read_json(path)
        data[key] = value
        fd, tmp = tempfile.mkstemp(prefix=".tune-", suffix=".json", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def cached_entry(kernel: str, arch: str, key: tuple) -> dict | None:
    """The stored tuning record {"config", "ms", "timings", "time"} for a key (cached or shipped), or None."""
    return _entry(kernel, arch, _key_str(key))


def _progress(n: int, desc: str):
    """A (advance, close) pair drawing a progress bar on stderr with rich or tqdm, else plain lines."""
    try:
        from rich.console import Console
        from rich.progress import Progress

        prog = Progress(transient=True, console=Console(stderr=True))  # stdout carries the CLI's report and JSON
        prog.start()
        task = prog.add_task(desc, total=n)
        return (lambda: prog.advance(task)), prog.stop
    except Exception:
        pass
    try:
        from tqdm import tqdm

        bar = tqdm(total=n, desc=desc, file=sys.stderr, leave=False)
        return (lambda: bar.update(1)), bar.close
    except Exception:
        counter = [0]

        def advance():
            counter[0] += 1
            print(f"{desc}: {counter[0]}/{n}", file=sys.stderr)

        return advance, (lambda: None)


def pick_config(
    kernel: str,
    arch: str,
    key: tuple,
    candidates: Sequence[dict],
    default: dict,
    bench: Callable[[dict], float],
) -> dict:
    """The config for (kernel, arch, key): cached winner, else tuned winner (if enabled), else, suspended where it
    would tune, the first candidate, else `default` (module docstring)."""
    cached = _cached_config(kernel, arch, key, candidates, default)
    if cached is not None:
        return cached
    if not candidates or not _tunes(arch):
        return dict(default)
    if _SUSPENDED.get():
        return dict(candidates[0])
    kstr = _key_str(key)
    mkey = (cache_dir(), kernel, arch, kstr)

    timings: list[float] = []
    advance, close = _progress(len(candidates), f"tkopt autotune {kernel} {arch}")
    try:
        for cfg in candidates:
            try:
                ms = float(bench(dict(cfg)))
            except Exception as exc:  # a candidate that fails to compile or run is skipped
                print(f"tkopt autotune {kernel}: candidate {cfg} failed: {type(exc).__name__}: {exc}"[:400],
                      file=sys.stderr)
                ms = math.inf
            if not (ms == ms) or ms <= 0:  # NaN or non-positive: not a valid timing
                ms = math.inf
            timings.append(ms)
            advance()
    finally:
        close()
    best = min(range(len(timings)), key=timings.__getitem__)
    if not math.isfinite(timings[best]):
        print(f"tkopt autotune {kernel} {arch}: every candidate failed; using the default", file=sys.stderr)
        return dict(default)
    winner = dict(candidates[best])
    entry = {
        "config": _norm(winner),
        "ms": timings[best],
        "timings": [[_norm(c), t if math.isfinite(t) else None] for c, t in zip(candidates, timings, strict=True)],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    try:
        store_json(_file(kernel, arch), kstr, entry)
    except OSError as exc:  # a read-only cache dir must not break the kernel
        print(f"tkopt autotune: could not write the cache ({exc}); keeping the winner in memory", file=sys.stderr)
    with _LOCK:
        _MEMORY[mkey] = winner
    return dict(winner)


def _cached_config(kernel: str, arch: str, key: tuple, candidates: Sequence[dict], default: dict) -> dict | None:
    """The winner for (kernel, arch, key) in memory or on disk, if it is still one of `candidates` or `default`
    (the caller's own dict, tuples intact); else None."""
    kstr = _key_str(key)
    mkey = (cache_dir(), kernel, arch, kstr)
    with _LOCK:
        hit = _MEMORY.get(mkey)
    if hit is not None:
        return dict(hit)
    allowed = [_norm(c) for c in candidates] + [_norm(default)]
    entry = _entry(kernel, arch, kstr)
    if not (entry and isinstance(entry.get("config"), dict) and _norm(entry["config"]) in allowed):
        return None
    cfg = dict((list(candidates) + [default])[allowed.index(_norm(entry["config"]))])
    with _LOCK:
        _MEMORY[mkey] = cfg
    return dict(cfg)


def planned_configs(kernel: str, arch: str, key: tuple, candidates: Sequence[dict], default: dict) -> list[dict]:
    """The configs a `pick_config` call with these arguments compiles, each once: the cached winner; else, where
    it would tune, every candidate (a suspended call takes the first; the default, which tuning never times, is
    compiled where it is used: only if every candidate fails); else the default. What a build ahead of the calls
    compiles."""
    cached = _cached_config(kernel, arch, key, candidates, default)
    if cached is not None:
        return [cached]
    configs = candidates if candidates and _tunes(arch) else [default]
    return list({json.dumps(_norm(c), sort_keys=True): dict(c) for c in configs}.values())


def clear_memory_cache() -> None:
    """Forget in-process winners (the files stay); for tests and after changing TKOPT_CACHE_DIR."""
    with _LOCK:
        _MEMORY.clear()


__all__ = [
    "cache_dir",
    "cached_entry",
    "clear_memory_cache",
    "pick_config",
    "planned_configs",
    "shape_bucket",
    "suspended",
    "tuning_enabled",
    "tuning_suspended",
]


def median_ms(fn, warmup: int = 3, reps: int = 10, calls: int = 1) -> float:
    """Median ms of fn() timed with CUDA events: how every kernel's tuning candidates are timed. Each rep times
    `calls` back-to-back calls (the result is per call), so that where candidates differ in host-side cost
    (a TileLang launch against a library call), a queue of work hides it as a program's stream does."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / calls)
    times.sort()
    return times[len(times) // 2]
