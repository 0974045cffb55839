"""tkopt/kernels/tuning.py: the autotune cache, on CPU with a fake bench function (real timings, no GPU)."""

import json
import math
import os

import pytest

from tkopt.kernels import tuning
from tkopt.kernels.tuning import cache_dir, pick_config, shape_bucket, tuning_enabled
from tkopt.kernels.workers import map_in_workers

CANDS = [dict(bm=64, stages=2), dict(bm=128, stages=3), dict(bm=256, stages=4)]
DEFAULT = dict(bm=128, stages=2)


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TKOPT_AUTOTUNE", raising=False)
    tuning.clear_memory_cache()
    yield
    tuning.clear_memory_cache()


def _bench_factory(times, calls):
    def bench(cfg):
        calls.append(dict(cfg))
        t = times[cfg["bm"]]
        if isinstance(t, Exception):
            raise t
        return t

    return bench


def test_cache_dir_env(tmp_path, monkeypatch):
    assert cache_dir() == str(tmp_path / "cache")
    monkeypatch.delenv("TKOPT_CACHE_DIR")
    assert cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "tkopt")


def test_tuning_enabled_env(monkeypatch):
    assert tuning_enabled("sm90") and tuning_enabled("sm80")
    assert not tuning_enabled("cpu")
    for off in ("0", "false", "OFF"):
        monkeypatch.setenv("TKOPT_AUTOTUNE", off)
        assert not tuning_enabled("sm90")
    monkeypatch.setenv("TKOPT_AUTOTUNE", "1")
    assert tuning_enabled("sm90") and not tuning_enabled("cpu")


def test_shape_bucket():
    assert [shape_bucket(n) for n in (0, 1, 2, 3, 5, 64, 65, 1000)] == [1, 1, 2, 4, 8, 64, 128, 1024]
    assert shape_bucket(10**9) == 1 << 16
    assert shape_bucket(300, cap=256) == 256


def test_tunes_caches_and_reuses(tmp_path):
    calls = []
    bench = _bench_factory({64: 3.0, 128: 1.0, 256: 2.0}, calls)
    got = pick_config("gemm", "sm90", (1024, 512, "float16"), CANDS, DEFAULT, bench)
    assert got == dict(bm=128, stages=3) and len(calls) == 3
    path = tmp_path / "cache" / "tune-gemm-sm90.json"
    data = json.loads(path.read_text())
    (entry,) = data.values()
    assert entry["config"] == dict(bm=128, stages=3) and entry["ms"] == 1.0
    assert [t for _, t in entry["timings"]] == [3.0, 1.0, 2.0]
    # Warm in-process: no bench.
    assert pick_config("gemm", "sm90", (1024, 512, "float16"), CANDS, DEFAULT, bench) == got
    assert len(calls) == 3
    # A fresh process (memory cleared) reads the file, does not bench.
    tuning.clear_memory_cache()
    assert pick_config("gemm", "sm90", (1024, 512, "float16"), CANDS, DEFAULT, bench) == got
    assert len(calls) == 3
    # Another key tunes again; another arch has its own file.
    pick_config("gemm", "sm90", (2048, 512, "float16"), CANDS, DEFAULT, bench)
    assert len(calls) == 6 and len(json.loads(path.read_text())) == 2
    pick_config("gemm", "sm80", (1024, 512, "float16"), CANDS, DEFAULT, bench)
    assert (tmp_path / "cache" / "tune-gemm-sm80.json").exists()


def test_failures_are_skipped_and_all_failed_gives_default(tmp_path):
    calls = []
    bench = _bench_factory({64: RuntimeError("smem"), 128: math.inf, 256: 5.0}, calls)
    assert pick_config("k", "sm90", (1,), CANDS, DEFAULT, bench) == CANDS[2]
    bench2 = _bench_factory({64: RuntimeError("x"), 128: float("nan"), 256: math.inf}, [])
    assert pick_config("k", "sm90", (2,), CANDS, DEFAULT, bench2) == DEFAULT
    data = json.loads((tmp_path / "cache" / "tune-k-sm90.json").read_text())
    assert len(data) == 1  # all-failed result is not cached


def test_disabled_and_cpu_use_default_without_bench(tmp_path, monkeypatch):
    calls = []
    bench = _bench_factory({64: 1.0, 128: 2.0, 256: 3.0}, calls)
    assert pick_config("k", "cpu", (1,), CANDS, DEFAULT, bench) == DEFAULT
    monkeypatch.setenv("TKOPT_AUTOTUNE", "0")
    assert pick_config("k", "sm90", (1,), CANDS, DEFAULT, bench) == DEFAULT
    assert calls == [] and not (tmp_path / "cache").exists()


def test_cached_winner_used_even_when_tuning_disabled(monkeypatch):
    calls = []
    bench = _bench_factory({64: 1.0, 128: 2.0, 256: 3.0}, calls)
    assert pick_config("k", "sm90", (7,), CANDS, DEFAULT, bench) == CANDS[0]
    tuning.clear_memory_cache()
    monkeypatch.setenv("TKOPT_AUTOTUNE", "0")
    assert pick_config("k", "sm90", (7,), CANDS, DEFAULT, bench) == CANDS[0]
    assert len(calls) == 3


def test_stale_winner_not_in_candidates_retunes():
    calls = []
    bench = _bench_factory({64: 1.0, 128: 2.0, 256: 3.0}, calls)
    assert pick_config("k", "sm90", (9,), CANDS, DEFAULT, bench) == CANDS[0]
    tuning.clear_memory_cache()
    assert pick_config("k", "sm90", (9,), CANDS[1:], DEFAULT, bench) == CANDS[1]
    assert len(calls) == 5


def test_tuple_values_round_trip():
    cands = [dict(tile=(128, 128, 64)), dict(tile=(64, 64, 32))]
    bench = lambda c: 1.0 if c["tile"][0] == 64 else 2.0  # noqa: E731
    assert pick_config("t", "sm90", (1,), cands, cands[0], bench) == cands[1]
    tuning.clear_memory_cache()
    got = pick_config("t", "sm90", (1,), cands, cands[0], bench)
    assert got == cands[1] and isinstance(got["tile"], tuple)


def _worker(args):
    d, i = args
    os.environ["TKOPT_CACHE_DIR"] = d
    tuning.clear_memory_cache()
    return pick_config("mp", "sm90", (i,), CANDS, DEFAULT, lambda c: float(c["bm"]))


def test_concurrent_processes_merge(tmp_path):
    d = str(tmp_path / "cache")
    res = map_in_workers(_worker, [(d, i) for i in range(8)], 2)
    assert all(r == CANDS[0] for r in res)
    data = json.loads((tmp_path / "cache" / "tune-mp-sm90.json").read_text())
    assert len(data) == 8  # no process's entry lost
    assert not [f for f in os.listdir(d) if f.startswith(".tune-")]  # no temp files left


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A shipped-winners folder of our own: {kernel: {key: record}} -> written there, the file memo cleared."""
    folder = tmp_path / "shipped"
    folder.mkdir()
    monkeypatch.setattr(tuning, "SHIPPED_DIR", str(folder))
    monkeypatch.delenv("TKOPT_SHIPPED_TUNING", raising=False)
    tuning._shipped_file.cache_clear()

    def ship(kernel, arch, key, config):
        record = {"config": config, "ms": 1.0, "time": "2026-12-01T00:00:00", "device": "test"}
        (folder / tuning.file_name(kernel, arch)).write_text(json.dumps({tuning._key_str(key): record}))
        tuning._shipped_file.cache_clear()

    yield ship
    tuning._shipped_file.cache_clear()


def test_a_shipped_winner_is_used_without_tuning_and_is_all_a_build_plans(shipped):
    shipped("k", "sm90", (1, 2), CANDS[2])
    calls = []
    bench = _bench_factory({64: 1.0, 128: 1.0, 256: 1.0}, calls)
    assert pick_config("k", "sm90", (1, 2), CANDS, DEFAULT, bench) == CANDS[2] and calls == []
    assert tuning.planned_configs("k", "sm90", (1, 2), CANDS, DEFAULT) == [CANDS[2]]
    assert tuning.cached_entry("k", "sm90", (1, 2))["device"] == "test"
    # Another key, or another arch, tunes as before.
    assert len(tuning.planned_configs("k", "sm90", (1, 3), CANDS, DEFAULT)) == 3
    assert pick_config("k", "sm80", (1, 2), CANDS, DEFAULT, bench) == CANDS[0] and len(calls) == 3


def test_this_machines_winner_overrides_the_shipped_one(shipped):
    shipped("k", "sm90", (1, 2), CANDS[2])
    calls = []
    tuning.store_json(tuning._file("k", "sm90"), tuning._key_str((1, 2)), {"config": tuning._norm(CANDS[1]), "ms": 1.0})
    assert pick_config("k", "sm90", (1, 2), CANDS, DEFAULT, _bench_factory({}, calls)) == CANDS[1] and calls == []


def test_a_stale_or_disabled_shipped_winner_tunes(shipped, monkeypatch):
    shipped("k", "sm90", (1, 2), dict(bm=512, stages=9))  # no longer a candidate: the search space changed
    calls = []
    bench = _bench_factory({64: 3.0, 128: 1.0, 256: 2.0}, calls)
    assert pick_config("k", "sm90", (1, 2), CANDS, DEFAULT, bench) == CANDS[1] and len(calls) == 3
    tuning.clear_memory_cache()
    shipped("k", "sm90", (1, 4), CANDS[2])
    monkeypatch.setenv("TKOPT_SHIPPED_TUNING", "0")
    assert len(tuning.planned_configs("k", "sm90", (1, 4), CANDS, DEFAULT)) == 3
    assert pick_config("k", "sm90", (1, 4), CANDS, DEFAULT, bench) == CANDS[1] and len(calls) == 6
