"""Targets: the only part of tkopt that knows the device an optimized graph will run on.

A target probes fused nodes' kernels, measures a fused node against what the target would otherwise run
in its place, emits the optimized artifact, and times that artifact against the plain alternatives the
user already has. The pipeline (tkopt.pipeline) decides with these answers; the targets decide nothing.

- `TorchTarget` (torch_target.py): "torch-cpu" (eager ATen is the alternative) and "torch-cuda"
  (inductor and CUDA graphs are), for tkopt.compile and torch.compile(backend="tkopt").
- `OrtTarget` (ort_target.py): "ort-cpu", "ort-sm80", "ort-sm90" (ORT's own kernels are the
  alternative), and "onnx" (no kernels: fused nodes run their references; nothing to measure).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tkopt.ir import Graph, Node
from tkopt.measure import Timing

Wins = Callable[[Timing, Timing], bool]  # (fused, unfused) -> does the fused node win at this size?


@dataclass
class Measured:
    """A fused node against what it replaces: (fused, unfused) timings per size (or per way of running the
    unfused side) measured, in order (the target stops at the first where it loses; the node is kept only if
    it wins at every one), or the error that running its kernel raised."""

    node: Node
    sizes: list[tuple[Timing, Timing]] = field(default_factory=list)
    # a name per measurement, e.g. "batch 1, seq 128" or "example inputs, against inductor"
    labels: list[str] = field(default_factory=list)
    error: str | None = None


class Target(ABC):
    """Probe, measure and emit for one device (see the package docstring)."""

    name: str

    @abstractmethod
    def measurable(self) -> str | None:
        """None if measured selection can run here, else why not."""

    @abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """What a measurement on this target depends on beyond the node: device, threads, runtime versions."""

    @abstractmethod
    def probe(self, graph: Graph, nodes: list[Node], meanwhile: Callable[[], None] | None = None) -> dict[str, str]:
        """Build (and where possible run) each node's kernel: {node name: why it fails} for those that do.
        `meanwhile` (work that needs no kernel) runs while they build, where they build outside this process."""

    def check_kept(self, graph: Graph, nodes: list[Node]) -> dict[str, str]:
        """After selection, the kernels the kept `nodes` will run, checked as `probe` checks them where selection
        changed them (tuned them at the real shapes): {node name: why one fails}. By default selection changes
        none."""
        return {}

    @abstractmethod
    def node_key(self, graph: Graph, node: Node) -> Any:
        """The JSON-able key of a node's measurement (dtypes, shape buckets, attributes, what it replaced)."""

    @abstractmethod
    def measure(self, graph: Graph, nodes: list[Node], wins: Wins) -> Iterator[Measured]:
        """Each node against what it replaces, one Measured per node as it is done."""

    @abstractmethod
    def emit(self, graph: Graph) -> Any:
        """The artifact for the (sealed) graph."""

    def alternatives(self) -> list[str]:
        """Names of the plain alternatives the final artifact is compared with (none: no comparison)."""
        return []

    def races_unfused(self) -> bool:
        """Whether tkopt's program with no fusion still differs from the plain alternatives (so it is raced
        against them, and against the fused program): it does where the target runs the program its own way,
        e.g. as CUDA graphs."""
        return False

    def prepare_whole(self, programs: list[Any], likely: Callable[[], list[Any]]) -> None:
        """Ready what the whole-graph comparison will run that no selection changes (these programs of tkopt's and
        the alternatives: compiles, captures), so that it can happen while kernels build (where `races_unfused`), or
        start it there (a compile in another process); and start what can be of the programs `likely()` emits, which
        selection may yet change and whose kernels are not built (their compile, where it needs no call): called
        only where the target can, since emitting them costs time."""
        raise NotImplementedError

    def whole_key(self, graph: Graph, programs: dict[str, Any]) -> Any:
        """The JSON-able key of a whole-graph comparison of tkopt's `programs` (name -> artifact; none: the
        alternatives alone)."""
        raise NotImplementedError

    def compare_whole(self, graph: Graph, programs: dict[str, Any]) -> dict[str, Timing]:
        """Each of tkopt's `programs` (name -> artifact) and each alternative, timed on the example inputs."""
        raise NotImplementedError

    def alternative(self, name: str) -> Any:
        """The artifact of plain alternative `name` (when it beat tkopt's)."""
        raise NotImplementedError

    def runs_as(self, node: Node) -> str | None:
        """What a fused node runs as here where that is not tkopt's own kernel (ONNX Runtime's own ops), for the
        report; None: its kernel."""
        return None

    def stage_seconds(self) -> dict[str, float]:
        """Where the stages' time went inside the target ("stage: part" -> seconds), for the report."""
        return {}

    @property
    def where(self) -> str:
        """How warnings name the device ("cpu", "cuda:0", "ORT sm90")."""
        return self.name


def replaced_signature(node: Node) -> list[Any]:
    """What a fused node stands for, as a key: its replaced nodes' ops and scalar attributes in order."""
    def plain(v: Any) -> Any:
        if isinstance(v, bool | int | float | str) or v is None:
            return v
        if isinstance(v, list | tuple) and len(v) <= 8:
            return [plain(x) for x in v]
        return type(v).__name__
    return [[r.op, {k: plain(v) for k, v in sorted(r.attrs.items())}] for r in node.replaced]



def cpu_model() -> str:
    """The CPU's model name, for decision keys."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
