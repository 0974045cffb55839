"""Timing: one way to time a call on CPU (perf_counter) or CUDA (events, synchronized), and to compare two.

Used by measured selection (a fused node against what it replaces, a whole graph against the plain
alternative) and by the benchmarks, so a number in a report and a number in a benchmark mean the same.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Timing:
    """Latency of one variant over `runs` timed calls after `warmup` untimed ones (milliseconds)."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int
    warmup: int
    method: str  # "perf_counter" or "cuda_events"
    min_ms: float = math.nan  # the fastest call: what decisions compare (see `compare`)
    host_ms: float = math.nan  # the CPU's time to issue one call (`race` on CUDA; see `_turn`)

    @classmethod
    def of(cls, samples_ms: list[float], warmup: int, method: str, host_ms: list[float] = ()) -> Timing:
        q = np.percentile(samples_ms, [10, 90]) if samples_ms else [math.nan, math.nan]
        med = statistics.median(samples_ms) if samples_ms else math.nan
        low = min(samples_ms) if samples_ms else math.nan
        host = statistics.median(host_ms) if host_ms else math.nan
        return cls(float(med), float(q[0]), float(q[1]), len(samples_ms), warmup, method, float(low), float(host))


def _on_cuda(device: Any) -> bool:
    """Whether `device` (a torch.device or its name) is a CUDA device."""
    return getattr(device, "type", str(device).split(":")[0]) == "cuda"


def _method(cuda: bool) -> str:
    return "cuda_events" if cuda else "perf_counter"


def _cpu_sample(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _hot_sampler(burst: int, pause_s: float) -> Callable[[Callable[[], Any]], float]:
    """The fastest of `burst` back-to-back calls after `pause_s` of quiet. ONNX Runtime's CPU workers spin between
    the ops of one run, so inside a model each op finds them awake; two one-node sessions timed in turn instead
    find them asleep or wake the other's, which then compete for the cores: its SkipSimplifiedLayerNormalization
    (1x128x512, two threads) read 0.041 ms with its workers awake and 0.080 ms in turns, against 0.070 for the
    eight ops it replaces (2 cores, 2026-12-05)."""

    def sample(fn: Callable[[], Any]) -> float:
        time.sleep(pause_s)
        return min(_cpu_sample(fn) for _ in range(burst))

    return sample


def _cuda_sampler(device: Any) -> Callable[[Callable[[], Any]], float]:
    import torch

    def sample(fn: Callable[[], Any]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    return sample


class Timer:
    """Times calls on a device: CUDA events around each call on CUDA, perf_counter elsewhere.

    `runs` timed calls after `warmup` untimed ones, cut short after `max_seconds` of timed calls (at
    least `min_runs` are taken). On CPU with `burst` > 1 each sample is the fastest of that many calls in a row
    after a quiet `pause_s` (_hot_sampler: ONNX Runtime's sessions).
    """

    def __init__(self, device: Any = "cpu", runs: int = 20, warmup: int = 2, max_seconds: float | None = None,
                 min_runs: int = 3, burst: int = 1, pause_s: float = 0.02) -> None:
        self.cuda = _on_cuda(device)
        self.device = device
        self.runs, self.warmup, self.max_seconds, self.min_runs = runs, warmup, max_seconds, min_runs
        self.sample = (_cuda_sampler(device) if self.cuda else
                       _hot_sampler(burst, pause_s) if burst > 1 else _cpu_sample)

    @property
    def method(self) -> str:
        return _method(self.cuda)

    def over(self, t0: float, runs: int) -> bool:
        """Whether timing that began at perf_counter `t0` and took `runs` samples may stop for time."""
        return self.max_seconds is not None and time.perf_counter() - t0 > self.max_seconds and runs >= self.min_runs

    def __call__(self, fn: Callable[[], Any]) -> Timing:
        for _ in range(self.warmup):
            fn()
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
        samples: list[float] = []
        t0 = time.perf_counter()
        for _ in range(self.runs):
            samples.append(self.sample(fn))
            if self.over(t0, len(samples)):
                break
        return Timing.of(samples, self.warmup, self.method)


def race(fns: Mapping[str, Callable[[], Any]], device: Any = "cpu", runs: int = 20, warmup: int = 3,
         max_seconds: float = 3.0, lead: int = 2, burst: int = 4, warm_s: float = 1.0,
         turn_ms: float = 3.0) -> dict[str, Timing]:
    """Each variant timed as a user's loop runs it: `warmup` untimed calls each (CUDA-graph modes record on
    their second or third call), then rounds of one turn per variant, the order rotated each round so drift
    and the machine's other load hit all alike; median per variant. On CUDA a turn is the steady state of a
    loop of that variant alone: from an idle device, `lead` calls untimed, then `burst` calls bracketed by
    events, with no synchronization in between, so the CPU is as far ahead as it gets in a loop and a call's
    time is what the stream spends on it, its launch cost showing exactly where the CPU cannot keep ahead.
    Turns do not overlap: one call after another variant's still running would hide its launch cost behind
    that variant's work (an encoder layer's program raced at 0.246 ms and ran at 0.339 ms alone); and timed
    from the first call after a synchronization, a variant that launches many kernels paid its first
    call's host time uncovered (eager at 0.408 ms against 0.240 in a loop). On CUDA the warm-up rounds last
    at least `warm_s`: a race follows a compile that left the GPU and the CPU idle, at low clocks, and a few
    calls do not bring them back (an eager module read 0.364 ms first and 0.228 ms later in one run). Rounds
    stop after `max_seconds` (at least 5). A burst lasts at least `turn_ms` (up to 64 calls): four calls of a
    0.23 ms encoder layer timed its eager module 6% slower than its loop did, and the race kept a fused program
    that the loop then ran 7% slower than eager. On CUDA each Timing also holds `host_ms`, the CPU's time per
    call (`_turn`): where that comes near the call's time, the loop runs at the CPU's pace, not the GPU's."""
    cuda = _on_cuda(device)
    names = list(fns)
    t0 = time.perf_counter()
    done = 0
    while done < warmup or (cuda and time.perf_counter() - t0 < warm_s):
        for name in names:
            fns[name]()
        done += 1
    bursts = {name: _burst(_turn(fns[name], device, lead, burst)[0], burst, turn_ms) for name in names} if cuda else {}
    samples: dict[str, list[float]] = {name: [] for name in names}
    hosts: dict[str, list[float]] = {name: [] for name in names}
    t0 = time.perf_counter()
    for r in range(runs):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            if cuda:
                call_ms, host_ms = _turn(fns[name], device, lead, bursts[name])
                samples[name].append(call_ms)
                hosts[name].append(host_ms)
            else:
                samples[name].append(_cpu_sample(fns[name]))
        if r >= 4 and time.perf_counter() - t0 > max_seconds:
            break
    return {name: Timing.of(samples[name], done, _method(cuda), hosts[name]) for name in names}  # `done` warm-up rounds


def _burst(call_ms: float, least: int, turn_ms: float, most: int = 64) -> int:
    """Calls per timed burst: at least `least`, and enough that the burst lasts `turn_ms`."""
    return min(most, max(least, math.ceil(turn_ms / max(call_ms, 1e-3))))


def _turn(fn: Callable[[], Any], device: Any, lead: int, burst: int) -> tuple[float, float]:
    """(milliseconds per call of `burst` calls of `fn` after `lead` untimed ones, back to back from an idle
    device; the CPU's milliseconds per call). The CPU's time is the lesser of two readings that can each only
    overstate it: issuing the first lead call (nothing queued, so nothing blocks it, but it may pay a cold
    start) and issuing the burst (steady, but it blocks once the launch queue is full)."""
    import torch

    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first_ms = _cpu_sample(fn)
    for _ in range(lead - 1):
        fn()
    start.record()
    t0 = time.perf_counter()
    for _ in range(burst):
        fn()
    issued_ms = (time.perf_counter() - t0) * 1e3 / burst
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / burst, min(first_ms, issued_ms)


def time_calls(fn: Callable[[], Any], runs: int, warmup: int) -> Timing:
    """Wall-clock time of `fn()` (CPU work, or ORT runs, which return host arrays: synchronous)."""
    return Timer("cpu", runs, warmup)(fn)


def compare(fused: Callable[[], Any], unfused: Callable[[], Any], timer: Timer) -> tuple[Timing, Timing]:
    """(fused, unfused) timings, to be compared by their fastest calls: on a shared machine other processes
    only ever add time, so a variant's minimum is the steadiest estimate of its own cost. The two are called
    in turn, the order alternating, so a burst of other load lands on both sides alike (timed one after the
    other, a burst during the unfused side's second made a CPU add+norm kernel "50x" faster than ATen).
    Timing stops early once, after `min_runs` rounds, the fused side's fastest call is slower than the
    unfused side's fastest: it is losing, and slow kernels are what cost most to time."""
    for _ in range(timer.warmup):
        unfused()
        fused()
    if timer.cuda:
        import torch

        torch.cuda.synchronize(timer.device)
    f: list[float] = []
    u: list[float] = []
    t0 = time.perf_counter()
    for r in range(timer.runs):
        for samples, fn in ((u, unfused), (f, fused)) if r % 2 == 0 else ((f, fused), (u, unfused)):
            samples.append(timer.sample(fn))
        if len(f) >= timer.min_runs and min(f) > min(u) or timer.over(t0, len(f)):
            break
    return Timing.of(f, timer.warmup, timer.method), Timing.of(u, timer.warmup, timer.method)


def per_call(pair: tuple[Timing, Timing], calls: int) -> tuple[Timing, Timing]:
    """`pair` (as `compare` returns it) timed over replays of `calls` calls each, as times per call."""
    if calls == 1:
        return pair
    return tuple(dataclasses.replace(t, median_ms=t.median_ms / calls, p10_ms=t.p10_ms / calls,
                                     p90_ms=t.p90_ms / calls, min_ms=t.min_ms / calls,
                                     host_ms=t.host_ms / calls) for t in pair)


def speedup(base: Timing | None, other: Timing | None) -> float | None:
    """base median / other median (> 1: `other` is faster); None if either is missing."""
    if base is None or other is None or not other.median_ms > 0:
        return None
    return base.median_ms / other.median_ms
