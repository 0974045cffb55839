"""Guards on the module state tkopt.compile treats as constant: non-persistent buffers and plain tensor
attributes (causal masks, rotary frequencies). Their contents are folded and reasoned on (a mask proven
causal becomes causal=1), yet a user can still write to them after compiling. Each specialization records
every such tensor's identity and version counter; a call after one was replaced or written in place no longer
matches it, so the module is re-exported with the new contents, as torch.compile's guards re-trace.

Writes through `.data` bypass the version counter (as they bypass autograd) and are not seen; neither are
in-place writes to inference tensors, which have no version counter (their replacement still is).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no version counter
        return None


def constant_state(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(owner, attribute, tensor) for every tensor of `module` that is neither a parameter nor a persistent
    buffer: what the FX frontend gives `const` (tkopt.frontends.fx._mutable_state)."""
    found = []
    for m in module.modules():
        names = [n for n in m._non_persistent_buffers_set if m._buffers.get(n) is not None]
        names += [n for n, v in vars(m).items() if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)]
        found += [(m, n, getattr(m, n)) for n in names]
    return found


@dataclass
class StateGuard:
    """The constant state one specialization was compiled from."""

    entries: list[tuple[nn.Module, str, torch.Tensor, int | None]]

    @classmethod
    def record(cls, module: nn.Module, mutated: Iterable[str] = ()) -> StateGuard:
        """Guard `module`'s constant state, except the buffers its forward itself writes (`mutated`, as
        torch.export's graph signature names them): those are state the program updates, not constants."""
        skip = set(mutated)
        named = {id(t): n for n, t in module.named_buffers(remove_duplicate=False)}
        return cls([(m, n, t, _version(t)) for m, n, t in constant_state(module) if named.get(id(t)) not in skip])

    def changed(self) -> str | None:
        """Which guarded tensor was replaced or written since recording, or None if none was."""
        for owner, name, tensor, version in self.entries:
            now = getattr(owner, name, None)
            if now is not tensor:
                return f"{type(owner).__name__}.{name} was replaced"
            if version is not None and _version(tensor) != version:
                return f"{type(owner).__name__}.{name} was written in place"
        return None
