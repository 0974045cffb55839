"""Parallel work (kernel compiles) in worker processes that never import the user's `__main__`.

multiprocessing's spawn and forkserver children re-import the parent's main module, so a user script
without an `if __name__ == "__main__":` guard ran again in every worker: its prints repeated, its
files written again, its model reloaded (an 8-layer model compiled in 228 s instead of 98 s on the
H200). fork is no way out once CUDA or threads are live. So the workers fork from a zygote: a new
interpreter started on a fixed bootstrap (`python -c`), given the parent's `sys.path` so that it
resolves the same modules, which imports the kernel modules (torch and TileLang: about 3 s) before
any thread or CUDA exists in it, then forks one worker per request. Each of a wave's workers started as
an interpreter of its own paid those imports again: on the H200's 16 cores, 15 workers spent 45 s of
CPU importing beside inductor's compile, and the wave waited for them. `zygote(modules)` starts one
ahead (tkopt.compile does, before it exports), so that the wave's workers start in milliseconds.
Threads were measured as the alternative: TileLang's lowering holds the GIL (two threads lowering two
sm80 GEMMs: 6.1 s of CPU in 7.9 s wall), so only nvcc would overlap.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

# The zygote: mirror the parent's sys.path, send C-level and Python output to stderr, import the modules it is
# given, then, per message on its control socket (the parent's working directory, environment and sys.path of
# the moment, and two pipe ends, for the jobs and the results), fork a worker that takes them on, and answer its
# pid; it ends with the socket. A worker reads (module, function) pickled from its job pipe and imports it, then
# one pickled job at a time, and writes each pickled result.
_ZYGOTE = """\
import importlib, os, pickle, signal, socket, sys, traceback
sys.path[:] = pickle.loads(bytes.fromhex(sys.argv[1]))
control = socket.socket(fileno=int(sys.argv[2]))
os.dup2(2, 1)
sys.stdout = sys.stderr
for module in pickle.loads(bytes.fromhex(sys.argv[3])):
    try:
        importlib.import_module(module)
    except Exception:  # the worker whose job needs it reports it
        pass
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers


def work(jobs, results):
    module, name = pickle.load(jobs)
    fn = getattr(importlib.import_module(module), name)
    while True:
        try:
            job = pickle.load(jobs)
        except EOFError:
            return
        pickle.dump(fn(job), results)
        results.flush()


while True:
    try:
        message, fds, _, _ = socket.recv_fds(control, 1 << 20, 2)
    except OSError:
        break
    if not message:
        break
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its own subprocesses (nvcc) report their status
        control.close()
        code = 0
        try:
            cwd, env, path = pickle.loads(message)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            sys.path[:] = path
            work(os.fdopen(fds[0], "rb"), os.fdopen(fds[1], "wb"))
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stderr.flush()
        os._exit(code)
    for fd in fds:
        os.close(fd)
    control.send(str(pid).encode())
"""


# What every compile needs, imported by each zygote before the modules it is given: the kernel modules import TileLang
# only where they build a program (tkopt.kernels.libraries).
PRELOAD = ("tilelang.language",)

# TileLang's import asks torch whether CUDA is there; through the CUDA runtime that initializes CUDA, which a
# forked child then cannot use ("initialization error"). Through NVML (torch's switch for forking parents) it
# does not, so the workers, which get the caller's environment without it, may use CUDA as a fresh process does.
_NO_CUDA_INIT = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


class Zygote:
    """A started zygote (module docstring) that imported `modules`; `fork()` starts a worker from it. Each
    worker runs in the caller's environment and `sys.path` of its fork: TileLang and tkopt read their settings
    (cache folders, tuning) from the environment as they run, not at import, so a zygote started before the
    caller changed them still serves."""

    def __init__(self, modules: Sequence[str]) -> None:
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _ZYGOTE, pickle.dumps(list(sys.path)).hex(), str(theirs.fileno()),
                 pickle.dumps([*PRELOAD, *modules]).hex()], stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()],
                env=_NO_CUDA_INIT | os.environ)
        self._lock = threading.Lock()
        self._owner = os.getpid()

    def serves(self) -> bool:
        """Whether it is running and this process started it (a process forked from the caller shares its socket)."""
        return self._owner == os.getpid() and self._proc.poll() is None

    def fork(self) -> tuple[int, IO[bytes], IO[bytes]]:
        """A new worker: (its pid, the pipe its jobs go into, the pipe its results come from). Waits for the
        zygote's imports the first time."""
        jobs_r, jobs_w = os.pipe()
        results_r, results_w = os.pipe()
        try:
            with self._lock:
                request = pickle.dumps((os.getcwd(), dict(os.environ), list(sys.path)))
                socket.send_fds(self._control, [request], [jobs_r, results_w])
                answer = self._control.recv(64)
        except OSError as e:
            os.close(jobs_w)
            os.close(results_r)
            raise RuntimeError(f"the workers' zygote is gone ({e})") from e
        finally:
            os.close(jobs_r)
            os.close(results_w)
        if not answer:
            os.close(jobs_w)
            os.close(results_r)
            raise RuntimeError(f"the workers' zygote exited (status {self._proc.wait()}); its output is above")
        return int(answer), os.fdopen(jobs_w, "wb"), os.fdopen(results_r, "rb")

    def close(self) -> None:
        """End it now. Its workers are processes of their own that end with their job pipes, and it holds nothing
        but its imports, so it is killed, not asked to end: a warm compile, which starts no worker, closed it while
        it was still importing, and waited up to 0.7 s for that (BERT-base on the H200, 2026-12-06)."""
        self._control.close()
        self._proc.kill()
        self._proc.wait()


_current: Zygote | None = None
_current_lock = threading.Lock()


@contextlib.contextmanager
def zygote(modules: Sequence[str]) -> Iterator[None]:
    """Start a zygote that imports `modules` now, for every `map_in_workers` call until the block ends, and end
    it then. Inside another such block, the outer zygote serves."""
    global _current
    with _current_lock:
        if _current is not None:
            mine = None
        else:
            mine = _current = Zygote(modules)
    try:
        yield
    finally:
        if mine is not None:
            with _current_lock:
                _current = None
            mine.close()


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
        self._pids: list[int] = []
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            pids = list(self._pids)
        for pid in pids:
            _kill(pid)

    def started(self, pid: int) -> bool:
        """Record worker `pid`; False where the call is already cancelled (the caller then stops)."""
        with self._lock:
            if not self.cancelled:
                self._pids.append(pid)
            return not self.cancelled


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def default_workers(n_jobs: int) -> int:
    """Workers for n_jobs: one per core but one, at most one per job."""
    return max(1, min(n_jobs, (os.cpu_count() or 2) - 1))


def map_in_workers(fn: Callable[[Any], Any], jobs: Sequence[Any], workers: int,
                   cancel: Cancel | None = None) -> list[Any]:
    """[fn(job) for job in jobs], run in `workers` workers forked from the zygote (`zygote`'s, else one
    started for this call); `cancel` stops it from another thread.

    Jobs go out in their order, each to the next worker that is free (a shared queue, not a fixed deal): with
    the longest first, the longest runs never queue behind others. A static round-robin gave one worker two
    long jobs while others sat idle. `fn` must be a module-level function of an importable module (not
    `__main__`: importing that would run the user's script); jobs and results must pickle. A worker that ends
    early raises RuntimeError (after the other workers finish the queue); exceptions inside `fn` are the
    caller's to catch and return.
    """
    module, name = fn.__module__, fn.__qualname__
    if module == "__main__" or "." in name:
        raise ValueError(f"map_in_workers: {module}.{name} is not importable by a worker; define it at the top "
                         "level of an importable module")
    with _current_lock:
        shared = _current if _current is not None and _current.serves() else None
    with contextlib.ExitStack() as stack:
        source = shared or Zygote([module])
        if shared is None:
            stack.callback(source.close)
        return _map(source, (module, name), jobs, workers, cancel)


def _map(source: Zygote, fn: tuple[str, str], jobs: Sequence[Any], workers: int, cancel: Cancel | None) -> list[Any]:
    queue = collections.deque(range(len(jobs)))
    lock = threading.Lock()
    results: list[Any] = [None] * len(jobs)
    running: dict[int, bool] = {}  # pid -> still serving
    failed: list[int] = []

    def serve(pid: int, jobs_in: IO[bytes], results_out: IO[bytes]) -> None:
        """Hand worker `pid` the next job until none is left or it ends."""
        try:
            with jobs_in, results_out:
                pickle.dump(fn, jobs_in)
                while True:
                    with lock:
                        if not queue:
                            break
                        i = queue.popleft()
                    pickle.dump(jobs[i], jobs_in)
                    jobs_in.flush()
                    results[i] = pickle.load(results_out)
        except (OSError, EOFError, pickle.UnpicklingError):  # it ended: its output on stderr says why
            with lock:
                failed.append(pid)
        finally:
            with lock:
                running[pid] = False

    threads = []
    try:
        for _ in range(min(workers, len(jobs))):
            pid, jobs_in, results_out = source.fork()
            with lock:
                running[pid] = True
            threads.append(threading.Thread(target=serve, args=(pid, jobs_in, results_out), daemon=True))
            threads[-1].start()
            if cancel is not None and not cancel.started(pid):
                raise RuntimeError(f"map_in_workers: {'.'.join(fn)} was cancelled")
        for t in threads:
            t.join()
    finally:  # an interrupted parent leaves no compiling orphans
        with lock:
            alive = [pid for pid, serving in running.items() if serving]
        for pid in alive:
            _kill(pid)
    if cancel is not None and cancel.cancelled:
        raise RuntimeError(f"map_in_workers: {'.'.join(fn)} was cancelled")
    if failed:
        raise RuntimeError(f"map_in_workers: {len(failed)} of {len(running)} workers for {'.'.join(fn)} failed "
                           "(each ended before its jobs did); their output is above on stderr")
    return results
