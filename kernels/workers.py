"""Parallel work (kernel compiles) in fresh interpreters that never import the user's `__main__`.

multiprocessing's spawn and forkserver children re-import the parent's main module, so a user script
without an `if __name__ == "__main__":` guard ran again in every worker: its prints repeated, its
files written again, its model reloaded (an 8-layer model compiled in 228 s instead of 98 s on the
H200). fork is no way out once CUDA or threads are live. So each worker here is a new interpreter
started on a fixed bootstrap (`python -c`), given the parent's `sys.path` so that it resolves the same
modules, which imports only the module that defines the job function (as torch inductor's compile
workers do). Threads were measured as the alternative: TileLang's lowering holds the GIL (two
threads lowering two sm80 GEMMs: 6.1 s of CPU in 7.9 s wall), so only nvcc would overlap.
"""

from __future__ import annotations

import collections
import importlib
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# The worker: mirror the parent's sys.path, read (module, function) pickled on stdin and import it, send C-level
# and Python output of the jobs to stderr; then, until stdin ends, read one pickled job and write its pickled
# result on the real stdout.
_BOOTSTRAP = """\
import importlib, os, pickle, sys
sys.path[:] = pickle.loads(bytes.fromhex(sys.argv[1]))
out = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)
sys.stdout = sys.stderr
module, name = pickle.load(sys.stdin.buffer)
fn = getattr(importlib.import_module(module), name)
while True:
    try:
        job = pickle.load(sys.stdin.buffer)
    except EOFError:
        break
    pickle.dump(fn(job), out)
    out.flush()
"""


@dataclass(frozen=True)
class Compile:
    """One kernel compile, as a job any process can run: `fn` ("module:function", importable by a worker)
    called with `args` (picklable and hashable, so equal compiles are one job). The function fills TileLang's
    disk cache and its kernel module's in-process cache; run again in another process, it loads from disk."""

    fn: str
    args: tuple

    @classmethod
    def of(cls, fn: Callable[..., Any], *args: Any) -> Compile:
        return cls(f"{fn.__module__}:{fn.__qualname__}", args)

    def run(self) -> Any:
        module, name = self.fn.split(":")
        return getattr(importlib.import_module(module), name)(*self.args)


def compile_job(job: Compile) -> str | None:
    """One compile -> None, or why it failed: what a build wave's workers run. Here, not with the wave's planner
    (tkopt.targets.kernel_builds), so that a worker imports only this module and the job's kernel module: the
    planner's imports (tkopt's IR, sympy, the targets) cost each worker about a second."""
    try:
        job.run()
    except Exception as e:  # noqa: BLE001 - the parent's own probe or tuning reports it
        return f"{type(e).__name__}: {e}"
    return None


class Cancel:
    """Stops a `map_in_workers` call from another thread: `cancel()` kills the workers it started and keeps it
    from starting more, and the call raises RuntimeError. tkopt's probe compiles the whole graph while a thread
    waits on the build wave; interrupted there (Ctrl-C), it leaves at once instead of when the wave ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen] = []
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            procs = list(self._procs)
        for p in procs:
            if p.poll() is None:
                p.kill()

    def started(self, p: subprocess.Popen) -> bool:
        """Record worker `p`; False where the call is already cancelled (the caller then stops)."""
        with self._lock:
            if not self.cancelled:
                self._procs.append(p)
            return not self.cancelled


def default_workers(n_jobs: int) -> int:
    """Workers for n_jobs: one per core but one, at most one per job."""
    return max(1, min(n_jobs, (os.cpu_count() or 2) - 1))


def map_in_workers(fn: Callable[[Any], Any], jobs: Sequence[Any], workers: int,
                   cancel: Cancel | None = None) -> list[Any]:
    """[fn(job) for job in jobs], run in `workers` fresh interpreters; `cancel` stops it from another thread.

    Jobs go out in their order, each to the next worker that is free (a shared queue, not a fixed deal): with
    the longest first, the longest runs never queue behind others. A static round-robin gave one worker two
    long jobs while others sat idle. `fn` must be a module-level function of an importable module (not
    `__main__`: importing that would run the user's script); jobs and results must pickle. A worker that fails
    raises RuntimeError naming its exit status (after the other workers finish the queue); exceptions inside
    `fn` are the caller's to catch and return.
    """
    module, name = fn.__module__, fn.__qualname__
    if module == "__main__" or "." in name:
        raise ValueError(f"map_in_workers: {module}.{name} is not importable by a worker; define it at the top "
                         "level of an importable module")
    path = pickle.dumps(list(sys.path)).hex()
    queue = collections.deque(range(len(jobs)))
    lock = threading.Lock()
    results: list[Any] = [None] * len(jobs)
    procs: list[subprocess.Popen] = []

    def serve(p: subprocess.Popen) -> None:
        """Hand `p` the next job until none is left or `p` dies (its exit status then says why)."""
        try:
            pickle.dump((module, name), p.stdin)
            while True:
                with lock:
                    if not queue:
                        break
                    i = queue.popleft()
                pickle.dump(jobs[i], p.stdin)
                p.stdin.flush()
                results[i] = pickle.load(p.stdout)
            p.stdin.close()
        except (OSError, EOFError, pickle.UnpicklingError):  # the worker died: p.wait() reports it
            p.kill()

    try:
        for _ in range(min(workers, len(jobs))):
            p = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, path], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE)
            procs.append(p)
            if cancel is not None and not cancel.started(p):
                raise RuntimeError(f"map_in_workers: {module}.{name} was cancelled")
        threads = [threading.Thread(target=serve, args=(p,), daemon=True) for p in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [p.returncode for p in procs if p.wait() != 0]
    finally:  # an interrupted parent leaves no compiling orphans
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed:
        raise RuntimeError(f"map_in_workers: {len(failed)} of {len(procs)} workers for {module}.{name} failed "
                           f"(exit status {failed}); their output is above on stderr")
    return results
