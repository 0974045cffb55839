"""The house's floors (README, "How it is built"): no import circles among tkopt's modules, only the
pipeline reaches into the passes, and the bottom (IR, fused-op definitions, kernels) imports nothing
above it. Imports inside functions count: a circle broken only by a deferred import is still a circle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "tkopt").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The tkopt modules `name` imports anywhere in its file (module level or inside functions)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {m for m in found if m in known and m != name}


def import_graph() -> nx.DiGraph:
    modules = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        g.add_edges_from((name, m) for m in _imports(name, path, set(modules)))
    return g


def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_no_import_circles() -> None:
    g = import_graph()
    circles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert circles == [], f"import circles: {circles}"


def test_only_the_pipeline_reaches_into_the_passes() -> None:
    """Backends, targets and the ORT library never import passes: unfusing and sealing happen in the pipeline.
    Above it only the report (the passes' summary), the CLI (--list-passes) and the fuzzer (which tells
    tkopt's own frames in a traceback by their folders) may."""
    allowed = ("tkopt.passes", "tkopt.pipeline", "tkopt.report", "tkopt.cli", "tkopt.fuzz")
    bad = sorted((a, b) for a, b in import_graph().edges if _under(b, "tkopt.passes") and not _under(a, *allowed))
    assert bad == [], f"modules importing the passes: {bad}"


def test_the_bottom_imports_nothing_above_it() -> None:
    """IR and fused-op definitions import only the bottom; kernels never import the IR (or anything of tkopt's)."""
    g = import_graph()
    bottom = ("tkopt.ir", "tkopt.fused_ops", "tkopt.kernels")
    bad = sorted((a, b) for a, b in g.edges if _under(a, *bottom) and not _under(b, *bottom))
    bad += sorted((a, b) for a, b in g.edges if _under(a, "tkopt.kernels") and not _under(b, "tkopt.kernels"))
    assert bad == [], f"imports from the bottom upwards: {bad}"


def test_the_graph_is_real() -> None:
    """The checks above see the imports that exist (so they can fail)."""
    g = import_graph()
    assert g.has_edge("tkopt.pipeline", "tkopt.passes.pipeline")
    assert g.has_edge("tkopt.ort.library", "tkopt.ort.native")  # relative import
    assert g.has_edge("tkopt.bench_torch", "tkopt.torch_compile")  # import inside a function


@pytest.mark.parametrize("name", ["kernels", "passes", "models"])
def test_a_checkout_on_sys_path_hides_no_other_package(name: str) -> None:
    """From a checkout's root (the working directory on sys.path, as pytest and `python -c` put it), a top-level
    name resolves outside the checkout: tkopt's subpackages live under tkopt/. Their folders once sat at the root
    (installed through package-dir), where `kernels/` hid the hub's `kernels` package that transformers >= 5
    imports, and every transformers model test failed on it."""
    code = f"import importlib.util as u; s = u.find_spec({name!r}); print(s.origin if s else '')"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    origin = r.stdout.strip()
    assert origin not in (str(ROOT / name / "__init__.py"), str(ROOT / f"{name}.py")), f"`{name}` resolves to {origin}"
