"""Gated MLP (SwiGLU / GeGLU): act(x @ Wg + bg) * (x @ Wu + bu), semantics: reference.gated_mlp_ref.

One kernel computes both GEMMs per output tile: the x tile is loaded once per K step and multiplied into
two fp32 accumulators (gate and up), and the epilogue applies bias, activation and the product before a
single store, so neither intermediate ever reaches global memory. The program builder is
`gemm.gemm_program(..., gated=True)`; `gated_mlp_program` below names its compile-time keys.

Weights: (K, N) each, or (N, K) linear weights with weights_transposed=True.
"""

from .arch import UnsupportedError
from .config import TileConfig, default_config
from .gemm_epilogue import (
    _check_tensor,
    _launch,
    _resolve_config,
    check_inputs,
    fp32_precision,
    gemm_program,
    select_config,
)
from .tuning import median_ms

GATED_ACTS = ("silu", "gelu", "gelu_tanh", "relu", "sigmoid")


def gated_mlp_program(arch, N, K, dtype, config: TileConfig, *, weights_transposed=False, has_bias=False,
                      act="silu", m=None, precision="ieee"):
    """The fused gated-MLP program (args: X (M,K), Wg, Wu, [bg (N,), bu (N,)], Out (M,N)); M dynamic if m is None."""
    return gemm_program(arch, N, K, dtype, config, b_transposed=weights_transposed, has_bias=has_bias, act=act,
                        gated=True, m=m, precision=precision)


def _check(x, w_gate, w_up, act, b_gate, b_up, weights_transposed, arch):
    if act not in GATED_ACTS:
        raise UnsupportedError(f"act: unsupported gate activation {act!r}; expected one of {GATED_ACTS}")
    arch, M, N, K, out_shape = check_inputs(x, w_gate, b_gate, act, None, weights_transposed, arch, name_b="w_gate")
    _check_tensor("w_up", w_up, x.device, x.dtype)
    if tuple(w_up.shape) != tuple(w_gate.shape):
        raise ValueError(f"w_up must have w_gate's shape {tuple(w_gate.shape)}, got {tuple(w_up.shape)}")
    if (b_gate is None) != (b_up is None):
        raise ValueError("b_gate and b_up must be given together (pass zeros for the missing one)")
    if b_up is not None:
        _check_tensor("b_up", b_up, x.device, x.dtype)
        if tuple(b_up.shape) != (N,):
            raise ValueError(f"b_up must have shape ({N},), got {tuple(b_up.shape)}")
    return arch, M, N, K, out_shape


def gated_mlp(x, w_gate, w_up, act="silu", b_gate=None, b_up=None, *, weights_transposed=False, out=None,
              arch=None, config=None):
    """act(x @ w_gate + b_gate) * (x @ w_up + b_up), both GEMMs and the gate fused in one kernel.

    x: (..., K); weights (K, N) or (N, K) with weights_transposed=True; biases (N,) (both or neither);
    act: "silu" (SwiGLU), "gelu" / "gelu_tanh" (GeGLU), "relu" or "sigmoid". fp32 on the GPU follows torch's
    matmul precision as `gemm` does. `config`: a TileConfig to force (else the default / tuned one);
    `arch`: force a variant.

    >>> import torch
    >>> from tkopt.kernels import gated_mlp
    >>> x, wg, wu = torch.randn(2, 5, 32), torch.randn(24, 32), torch.randn(24, 32)
    >>> y = gated_mlp(x, wg, wu, "silu", weights_transposed=True)  # SwiGLU with linear weights (N, K)
    >>> torch.allclose(y, torch.nn.functional.silu(x @ wg.T) * (x @ wu.T), atol=1e-5)
    True
    """
    arch, M, N, K, out_shape = _check(x, w_gate, w_up, act, b_gate, b_up, weights_transposed, arch)
    precision = fp32_precision(arch, x.dtype)
    args = (x, [w_gate, w_up], [b_gate, b_up], act, None, weights_transposed)
    if config is not None:
        cfg = _resolve_config(config, arch, x.dtype, gated=True, precision=precision)
    elif M == 0 or N == 0 or K == 0:
        cfg = default_config(arch, x.dtype, accumulators=2, precision=precision)
    else:
        def run(c):
            return median_ms(lambda: _launch(arch, c, *args, None, out_shape, M, N, K, True, precision))

        cfg = select_config("gated_mlp", arch, M, N, K, x.dtype, act, b_gate is not None, False,
                            weights_transposed, run, gated=True, precision=precision)
    return _launch(arch, cfg, *args, out, out_shape, M, N, K, True, precision)
