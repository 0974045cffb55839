"""The tuning winners shipped in tkopt/kernels/tuned/ (benchmarks/tuning_db.py): each is still a candidate of its
kernel's tuning space (a search space that changed makes a winner stale: it is then ignored and the kernel
tunes, so the folder must be measured again), and they spare a cold compile the candidates' builds."""

import json
from pathlib import Path

import pytest
import torch

from tkopt.kernels import attention, gemm_epilogue, norm, tuning
from tkopt.kernels.arch import Build

FILES = sorted(Path(tuning.SHIPPED_DIR).glob("tune-*.json"))


def _space(kernel: str, arch: str, key: list) -> tuple[dict, list[dict]]:
    """(default, candidates) of `kernel` for a stored key, as the kernel itself builds them."""
    if kernel in ("gemm", "gated_mlp"):
        m, n, dtype, precision = key[0], key[1], getattr(torch, key[3].removeprefix("torch.")), key[8]
        default, cands = gemm_epilogue.tuning_space(arch, m, n, dtype, kernel == "gated_mlp", precision, 132)
        return gemm_epilogue._candidate(default), cands
    if kernel == "gemm_library":  # TileLang's kernel or cuBLASLt's fused epilogue, per GEMM key
        return gemm_epilogue._TILELANG, [gemm_epilogue._TILELANG, gemm_epilogue._LIBRARY]
    if kernel == "flash_attention":
        return attention._tuning_space(arch, tuple(key))
    if kernel in ("layer_norm", "rms_norm"):
        return norm._tuning_space(key[0], key[1], arch)
    raise AssertionError(f"a shipped file for a kernel this test does not know: {kernel}")


def test_the_shipped_winners_cover_the_benchmark_kernels() -> None:
    assert {f.name for f in FILES} >= {"tune-gemm-sm90.json", "tune-flash_attention-sm90.json",
                                       "tune-layer_norm-sm90.json", "tune-rms_norm-sm90.json",
                                       "tune-gated_mlp-sm90.json", "tune-gemm_library-sm90.json"}


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_every_shipped_winner_is_still_a_candidate_of_its_kernel(path: Path) -> None:
    kernel, arch = path.stem.removeprefix("tune-").rsplit("-", 1)
    records = json.loads(path.read_text())
    assert records
    for kstr, record in records.items():
        assert {"config", "ms", "time", "device"} <= set(record), kstr
        default, cands = _space(kernel, arch, json.loads(kstr))
        allowed = [tuning._norm(c) for c in [*cands, default]]
        assert tuning._norm(record["config"]) in allowed, f"{path.name} {kstr}: {record['config']} is stale"


def test_a_shipped_gemm_winner_is_the_only_config_a_cold_build_plans(monkeypatch, tmp_path) -> None:
    """GPT-2's c_fc at batch 8 x 1024: one compile with the shipped winner, every candidate without it."""
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TKOPT_AUTOTUNE", raising=False)
    tuning.clear_memory_cache()
    build = Build("sm90", "sm_90", 132)
    args = (8192, 3072, 768, torch.float16, "gelu", True, False, True)
    shipped = gemm_epilogue.planned_kernels("gemm", build, *args)
    monkeypatch.setenv("TKOPT_SHIPPED_TUNING", "0")
    tuning.clear_memory_cache()
    assert len(shipped) == 1 and len(gemm_epilogue.planned_kernels("gemm", build, *args)) > 1
    tuning.clear_memory_cache()


def test_tuning_db_merges_fresh_winners_into_the_folder(tmp_path: Path) -> None:
    """benchmarks/tuning_db.py's merge: a key measured again replaces its record, other keys stay, each fresh
    record names its device, and only the GPU's arch is taken."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "tuning_db.py"
    spec = importlib.util.spec_from_file_location("tuning_db_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cache, db = tmp_path / "cache", tmp_path / "db"
    cache.mkdir()
    db.mkdir()
    (db / "tune-gemm-sm90.json").write_text(json.dumps({"a": {"config": {"x": 1}, "device": "old"},
                                                        "b": {"config": {"x": 2}, "device": "old"}}))
    (cache / "tune-gemm-sm90.json").write_text(json.dumps({"b": {"config": {"x": 3}}, "c": {"config": {"x": 4}}}))
    (cache / "tune-gemm-sm80.json").write_text(json.dumps({"d": {"config": {"x": 5}}}))
    assert module.merge(cache, db, "sm90", "H200") == {"tune-gemm-sm90.json": 3}
    merged = json.loads((db / "tune-gemm-sm90.json").read_text())
    assert merged == {"a": {"config": {"x": 1}, "device": "old"}, "b": {"config": {"x": 3}, "device": "H200"},
                      "c": {"config": {"x": 4}, "device": "H200"}}
    assert sorted(p.name for p in db.iterdir()) == ["tune-gemm-sm90.json"]
