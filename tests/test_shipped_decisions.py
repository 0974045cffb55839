"""The declines shipped with tkopt (tkopt.decisions): made from a run's decisions file, read where this machine has
no decision, and a shipped decline skips the node's kernel build and says where it was measured."""

from __future__ import annotations

import json

import pytest
import torch

import tkopt
from tkopt import decisions, pipeline
from tkopt.models.blocks import REFERENCE_MODELS
from tkopt.targets.torch_target import TorchTarget


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """An empty shipped folder in place of tkopt/selected, read afresh, with the shipped declines turned on."""
    folder = tmp_path / "selected"
    folder.mkdir()
    monkeypatch.setattr(decisions, "SHIPPED_DIR", folder)
    decisions._shipped.cache_clear()
    monkeypatch.setenv("TKOPT_SHIPPED_DECISIONS", "1")
    yield folder
    decisions._shipped.cache_clear()


def _ship(cache_file, folder) -> dict:
    entries = decisions.shippable(cache_file, "a test machine, 2026-12-06")
    (folder / cache_file.name).write_text(json.dumps(entries))
    decisions._shipped.cache_clear()
    return entries


def test_only_node_declines_ship_and_a_local_decision_comes_first(tmp_path, monkeypatch, shipped) -> None:
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path / "measuring"))
    run = decisions.DecisionCache("t", {"device": "gpu", "torch": "2.11"})
    slower = {"kept": False, "sizes": [{"label": "example inputs", "fused_ms": 2.0, "unfused_ms": 1.0}], "error": None}
    run.put(["FusedGemm", {"act": "relu"}], slower)
    run.put(["FusedAttention", {}], {**slower, "kept": True})
    run.put(["FusedAddNorm", {}], {**slower, "error": "RuntimeError: boom"})
    run.put([["whole", {}], 1.02, 1.25], {"winner": "eager", "times_ms": {}, "host_ms": {}})
    entries = _ship(run.file.path, shipped)
    assert len(entries) == 1 and next(iter(entries.values()))["shipped"] == "a test machine, 2026-12-06"

    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path / "user"))  # another machine: nothing measured there
    gemm = ["FusedGemm", {"act": "relu"}]

    def on(device: str = "gpu", torch: str = "2.11") -> decisions.DecisionCache:
        return decisions.DecisionCache("t", {"device": device, "torch": torch})

    user = on()
    assert user.get(gemm)["shipped"]
    assert user.get(["FusedAttention", {}]) is None and user.get(["FusedAddNorm", {}]) is None
    # the key is the target's fingerprint: another device or another torch measures for itself
    assert on(device="other gpu").get(gemm) is None and on(torch="2.12").get(gemm) is None
    user.put(gemm, {**slower, "kept": True})  # measured here: this machine's word counts
    assert on().get(gemm)["kept"]
    monkeypatch.setenv("TKOPT_SHIPPED_DECISIONS", "0")
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path / "third"))
    assert on().get(gemm) is None


def test_a_shipped_decline_builds_nothing_and_says_where_it_was_measured(tmp_path, monkeypatch, shipped) -> None:
    """A real compile's declines (every node made to lose: an unreachable margin), shipped, decide a compile on a
    machine with an empty cache: no kernel is built for them, the report names the shipped measurement, and the
    model still matches eager; with TKOPT_SHIPPED_DECISIONS=0 the nodes are built and measured again."""
    monkeypatch.setenv("TKOPT_KERNELS", "tilelang")
    monkeypatch.setattr(pipeline, "MARGIN", 1e9)
    model, inputs = REFERENCE_MODELS["mlp"]()
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path / "measuring"))
    first = tkopt.compile(model, inputs).tkopt_report
    assert first.nodes and all(d.decision == "slower" and not d.cached for d in first.nodes)
    assert len(_ship(tmp_path / "measuring" / "select-torch-cpu.json", shipped)) == len(first.nodes)

    probed: list[str] = []
    probe = TorchTarget.probe
    monkeypatch.setattr(TorchTarget, "probe", lambda self, graph, nodes, *rest: probed.extend(n.name for n in nodes)
                        or probe(self, graph, nodes, *rest))
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path / "user"))
    fast = tkopt.compile(model, inputs)
    report = fast.tkopt_report
    assert probed == [] and "kernels: parallel builds" not in report.seconds
    for d in report.nodes:
        assert d.decision == "slower" and d.cached, d
        assert "as measured on a test machine, 2026-12-06 (a shipped decision" in d.reason, d.reason
    with torch.no_grad():
        torch.testing.assert_close(fast(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)

    monkeypatch.setenv("TKOPT_SHIPPED_DECISIONS", "0")
    monkeypatch.setenv("TKOPT_CACHE_DIR", str(tmp_path / "measured here"))
    again = tkopt.compile(model, inputs).tkopt_report
    assert sorted(probed) == sorted(d.node for d in again.nodes) and not any(d.cached for d in again.nodes)


def test_the_packaged_declines_are_declines_with_their_origin() -> None:
    """What ships in tkopt/selected/ (benchmarks/ship_decisions.py's output): node keys under a target fingerprint
    without tkopt's versions, each a measured decline naming the GPU and date it was measured on."""
    for path in sorted(decisions.SHIPPED_DIR.glob("select-*.json")):
        for full, entry in json.loads(path.read_text()).items():
            fingerprint, key = json.loads(full)
            assert {"device", "torch"} <= set(fingerprint) and "sources" not in fingerprint, (path, fingerprint)
            assert isinstance(key, list) and isinstance(key[0], str), (path, key)
            assert entry["kept"] is False and entry["error"] is None and entry["sizes"], (path, key)
            assert all(s["fused_ms"] * pipeline.MARGIN > s["unfused_ms"] for s in entry["sizes"][-1:]), (path, key)
            assert entry["shipped"].startswith(fingerprint["device"]), (path, entry["shipped"])
