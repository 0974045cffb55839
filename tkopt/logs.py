"""TileLang's log, routed through Python logging under tkopt's control.

On import TileLang gives its logger a handler of its own that writes every kernel compile's INFO lines to
stdout (through tqdm), where they mix with the CLI's report and JSON. tkopt takes the logger over as soon as
TileLang is imported, whoever imports it: no handler of its own, records propagate to Python logging, level
WARNING, or INFO with `set_verbose(True)` (the CLI's --verbose, which also gives those records a handler on
stderr). `install()` (run by `import tkopt`) arranges it with a post-import hook, so nothing imports TileLang
early (it is slow).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

_verbose = False


def set_verbose(verbose: bool) -> None:
    """INFO from TileLang (kernel compiles) on stderr, or WARNING and up only (the default)."""
    global _verbose
    _verbose = verbose
    if "tilelang" in sys.modules:
        _route()


@contextlib.contextmanager
def loggers_at(level: int, names: Iterable[str]) -> Iterator[None]:
    """The named loggers at `level` for a block, each given back its own level afterwards."""
    levels = {n: logging.getLogger(n).level for n in names}
    for n in levels:
        logging.getLogger(n).setLevel(level)
    try:
        yield
    finally:
        for n, level_before in levels.items():
            logging.getLogger(n).setLevel(level_before)


def quiet_exporters() -> contextlib.AbstractContextManager[None]:
    """torch's ONNX exporter and onnxscript log warnings about optional packages (torchvision) on every export;
    only --verbose shows them."""
    return loggers_at(logging.ERROR, () if _verbose else ("torch.onnx", "onnxscript"))


def _route(module: ModuleType | None = None) -> None:
    logger = logging.getLogger("tilelang")
    for h in list(logger.handlers):
        logger.removeHandler(h)
    logger.setLevel(logging.INFO if _verbose else logging.WARNING)
    logger.propagate = not _verbose
    if _verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.INFO)  # some TileLang modules log DEBUG on loggers of their own
        handler.setFormatter(logging.Formatter("TileLang %(levelname)s: %(message)s"))
        logger.addHandler(handler)


class _Loader(importlib.abc.Loader):
    """TileLang's own loader (which the module keeps as its loader), then `_route`."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _route(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds "tilelang" with the other finders and wraps its loader in `_Loader`."""

    def find_spec(self, name: str, path: Any,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != "tilelang":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Route TileLang's log now if it is imported, else when it is (idempotent)."""
    if "tilelang" in sys.modules:
        _route()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
