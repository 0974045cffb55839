"""`torch.compile(model, backend="tkopt")` wherever tkopt is importable, installed or not.

pip installs an entry point (pyproject.toml) that Dynamo finds; a source checkout on sys.path has none,
and Dynamo answered "Invalid backend: 'tkopt'". So `import tkopt` names the backend in Dynamo's registry
itself, lazily: an entry point object whose `load()` imports tkopt.backends.dynamo only when the backend
is first used. The registry lives in torch._dynamo, which costs a second to import; `import tkopt` must
not pay that (nor torch's own import) for users who never compile, so if the registry is not loaded yet
the name is added the moment it is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from importlib.metadata import EntryPoint
from types import ModuleType
from typing import Any

NAME = "tkopt"
REGISTRY = "torch._dynamo.backends.registry"
BACKEND = EntryPoint(name=NAME, value="tkopt.backends.dynamo:tkopt_backend", group="torch_dynamo_backends")


def register(registry: ModuleType) -> None:
    """Name the backend in Dynamo's registry (a no-op where an installed entry point already did)."""
    registry._BACKENDS.setdefault(NAME, BACKEND)


class _AfterRegistryImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds Dynamo's registry module as the other finders do, and registers the backend once it has run."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != REGISTRY:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        self.loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        register(module)


def install() -> None:
    """Register now if Dynamo's registry is loaded, else as soon as it is."""
    registry = sys.modules.get(REGISTRY)
    if registry is not None:
        register(registry)
    elif not any(isinstance(f, _AfterRegistryImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterRegistryImport())
