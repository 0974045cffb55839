"""tkopt/kernels/workers.py and the parallel precompile: work runs in workers forked from a fresh interpreter that
never re-run the user's script (issue 8: a spawn pool re-imported __main__, repeating a script without a main
guard)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tkopt.kernels.workers import map_in_workers, zygote


def test_map_in_workers_returns_results_in_job_order():
    jobs = [f"/d{i}/f{i}" for i in range(5)]
    assert map_in_workers(os.path.basename, jobs, 2) == [f"f{i}" for i in range(5)]


def _pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def test_a_free_worker_takes_the_next_job():
    """Jobs go to whichever worker is free: the worker of the long first job runs only it, the other runs the rest
    (a fixed round-robin deal gave the long job's worker the third job too, which then waited behind it)."""
    pids = map_in_workers(_pid_after, [2.0, 0.01, 0.01, 0.01], 2)
    assert pids[0] not in pids[1:] and len(set(pids[1:])) == 1, pids


def _where(key: str) -> tuple[str | None, str, bool, int]:
    return os.environ.get(key), os.getcwd(), "colorsys" in sys.modules, os.getppid()


def test_workers_fork_from_the_zygote_started_ahead_in_the_callers_state(tmp_path, monkeypatch):
    """Inside `zygote(modules)` the workers fork from the zygote started at its top: they have its imports
    without importing (what the build wave's workers skip), and they run in the caller's environment and
    folder of the moment, set after the zygote started (TileLang's and tkopt's cache folders are read so)."""
    with zygote(["colorsys"]):
        monkeypatch.setenv("TKOPT_WORKERS_TEST", "set later")
        monkeypatch.chdir(tmp_path)
        first, second = map_in_workers(_where, ["TKOPT_WORKERS_TEST"] * 2, 2)
    assert first[:3] == ("set later", str(tmp_path), True), first
    assert first[3] == second[3] != os.getpid()  # both forked from one zygote
    alone = map_in_workers(_where, ["TKOPT_WORKERS_TEST"], 1)[0]  # outside: a zygote of its own, without colorsys
    assert alone[:3] == ("set later", str(tmp_path), False) and alone[3] != first[3], alone


def _capability(index: int) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(index)


@pytest.mark.gpu
def test_workers_forked_from_the_zygote_may_use_cuda():
    """The zygote imports TileLang, which asks torch about CUDA: where that initialized CUDA, every forked
    worker's CUDA call failed (the norm compiles of a cold GPT-2 wave did, and ran again in the probes, 7 s)."""
    import torch

    with zygote(["tilelang", "tkopt.kernels.attention", "tkopt.kernels.norm"]):
        assert map_in_workers(_capability, [0, 0], 2) == [torch.cuda.get_device_capability(0)] * 2


def test_map_in_workers_refuses_main_and_reports_a_dead_worker():
    def local(x):
        return x

    with pytest.raises(ValueError, match="not importable by a worker"):
        map_in_workers(local, [1], 1)
    with pytest.raises(RuntimeError, match="1 of 1 workers for .*_exit failed"):
        map_in_workers(os._exit, [3], 1)


def test_parallel_precompile_never_reruns_the_users_script(tmp_path):
    """A script without `if __name__ == "__main__":` that compiles kernels in parallel prints its line once,
    and the kernels compile (in two workers, loaded here afterwards)."""
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent("""\
        print("USER SCRIPT TOP LEVEL", flush=True)
        from tkopt.kernels.config import TileConfig
        from tkopt.kernels.gemm_epilogue import _CACHE, compiled_kernel, precompile

        cfg = TileConfig(block_tile=(8, 8, 8), stages=1, threads=1, use_tensorcore=False, swizzle=0, stage_c=False)
        keys = [("cpu", n, 8, "float32", cfg, False, False, None, False, False, None) for n in (8, 16)]
        results = precompile(keys, workers=2)
        assert [e for _, e in results.values()] == [None, None], results
        assert not _CACHE  # compiled in the workers, not here
        compiled_kernel(*keys[0])  # loads from TileLang's disk cache
        print("DONE", len(results), flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("USER SCRIPT TOP LEVEL") == 1, proc.stdout
    assert "DONE 2" in proc.stdout
