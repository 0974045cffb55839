"""Which kernel variant a tensor gets: "sm90" (Hopper), "sm80" (Ampere and newer non-Hopper), or "cpu".

Per-arch variants share one public API; this module is the only place that maps a device to a
variant and a variant to a TileLang target, so that tests can force a variant (e.g. run the
sm80 program on an H200 with TKOPT_ARCH=sm80).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ARCHS = ("sm90", "sm80", "cpu")
# TVM in TileLang 0.1.15 takes targets as JSON-style dicts; the "cuda -arch=..." string form is rejected.
TARGETS: dict[str, dict[str, str]] = {
    "sm90": {"kind": "cuda", "arch": "sm_90a"},
    "sm80": {"kind": "cuda", "arch": "sm_80"},
    "cpu": {"kind": "c"},
}


class UnsupportedError(ValueError):
    """A kernel was asked for an arch, dtype or shape it has no variant for; the message names which."""


def arch_of(t: torch.Tensor, override: str | None = None) -> str:
    """The variant for tensors on t's device; `override` or $TKOPT_ARCH force one (a GPU variant needs a GPU)."""
    return arch_for(t.device, override)


def arch_for(device: torch.device, override: str | None = None) -> str:
    """arch_of for tensors on `device`."""
    forced = override or os.environ.get("TKOPT_ARCH")
    if device.type == "cpu":
        if forced and forced != "cpu":
            raise UnsupportedError(f"arch {forced!r} needs CUDA tensors, got tensors on cpu")
        return "cpu"
    if device.type != "cuda":
        raise UnsupportedError(f"no kernel variant for device {device}")
    major, minor = torch.cuda.get_device_capability(device)
    native = "sm90" if (major, minor) == (9, 0) else "sm80" if major >= 8 else None
    if forced:
        if forced not in ARCHS or forced == "cpu":
            raise UnsupportedError(f"TKOPT_ARCH={forced!r} is not a GPU variant; expected sm90 or sm80")
        if forced == "sm90" and native != "sm90":
            raise UnsupportedError(f"sm90 kernels need a Hopper GPU; this one is sm_{major}{minor}")
        if native is None:
            raise UnsupportedError(f"GPU sm_{major}{minor} is older than sm_80; no kernel variant")
        return forced
    if native is None:
        raise UnsupportedError(f"GPU sm_{major}{minor} is older than sm_80; no kernel variant")
    return native


@dataclass(frozen=True)
class Build:
    """What kernels are built for, ahead of their calls: the variant, the GPU they will run on ("sm_90"; None
    on cpu) and its SM count (GEMM default tiles are sized against it). No GPU is needed to build for one."""

    arch: str
    gpu: str | None = None
    sms: int | None = None

    @classmethod
    def here(cls, device: torch.device) -> Build:
        """What kernels for tensors on `device` are built for in this process."""
        if device.type != "cuda":
            return cls("cpu")
        return cls(arch_for(device), device_sm(),
                   torch.cuda.get_device_properties(device).multi_processor_count)


def target_of(arch: str):
    """The tvm Target for an arch name (for tilelang.compile / tilelang.lower)."""
    import tilelang  # noqa: F401  (puts its bundled tvm on the path)
    from tvm.target import Target

    try:
        return Target(TARGETS[arch])
    except KeyError:
        raise UnsupportedError(f"unknown arch {arch!r}; expected one of {ARCHS}") from None


def device_sm() -> str | None:
    """This machine's GPU as "sm_XY", None without one."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def run_target(arch: str, device: str | None = None) -> dict[str, str] | str:
    """The TileLang target that builds `arch`'s program to run on this machine's GPU.

    TileLang embeds machine code only, and sm_80 code does not load on Hopper (CUDA_ERROR_NO_BINARY_FOR_GPU,
    seen on the H200): the sm80 variant on a newer GPU is built for that GPU's arch, with `run_pass_configs`
    keeping it the Ampere program (mma.sync + cp.async, no wgmma/TMA/warp specialization).
    `device` ("sm_90", ...) names the GPU instead of asking torch (to lower for it without one).
    """
    if arch == "cpu":
        return "c"
    device = device or device_sm()
    if arch == "sm80" and device is not None and device != "sm_80" and int(device[3:]) >= 90:
        return {"kind": "cuda", "arch": device}
    return dict(TARGETS[arch])


# Pass configs of the warp-specialized kernels that place their own syncs (gemm_epilogue._overlap_body,
# attention's persistent schedule): TileLang's thread-sync pass would put a __syncthreads between the producer and
# the consumers, which never meet there (deadlock).
OWN_SYNCS_PASS_CONFIGS = {"tl.disable_thread_storage_sync": True}


def run_pass_configs(arch: str, device: str | None = None) -> dict[str, bool]:
    """Pass configs that go with `run_target(arch, device)` (empty unless sm80 is built for a newer GPU)."""
    target = run_target(arch, device)
    if arch == "sm80" and isinstance(target, dict) and target["arch"] != "sm_80":
        return {"tl.disable_wgmma": True, "tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}
    return {}
