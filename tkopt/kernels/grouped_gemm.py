"""Grouped GEMM: two or three weights that read the same input, each with its own bias and output, in one launch
(semantics: reference.gemm_group_ref).

A layer's Q, K and V projections are three GEMMs of the same A. At small M each is a short kernel whose time is
mostly its launch and ramp (BERT-base at batch 1, seq 128: three 128x768x768 GEMMs); one grid over the three
weights' column tiles does the same work with one launch and three times the blocks. Each weight and output stays
its own tensor, so nothing is concatenated per call and the outputs are what the separate GEMMs return.

The program is `gemm_epilogue.gemm_program(..., groups=widths)`: each block picks its weight, bias and output by
its column tile (`_dispatcher`). Where no grouped program exists (fp32 on the GPU: the SIMT and tf32x3 programs;
`group_problem` names each case) each weight runs its own `gemm`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .arch import UnsupportedError
from .config import TileConfig
from .gemm_epilogue import (
    _padded,
    _resolve_config,
    check_inputs,
    compiled_kernel,
    fp32_precision,
    gemm,
    group_problem,
    pad_operands,
    select_config,
)
from .tuning import median_ms


def _check(a, weights, biases, b_transposed, arch):
    if len(weights) not in (2, 3):
        raise ValueError(f"weights: a grouped GEMM takes two or three weights, got {len(weights)}")
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"biases: one per weight ({len(weights)}), got {len(biases)}")
    if len({b is None for b in biases}) > 1:
        raise ValueError("biases: give every weight a bias or none (pass zeros for a missing one)")
    checked = [check_inputs(a, w, b, None, None, b_transposed, arch, name_b=f"weights[{g}]")
               for g, (w, b) in enumerate(zip(weights, biases, strict=True))]
    arch, M, _, K, _ = checked[0]
    return arch, M, K, [c[2] for c in checked], [c[4] for c in checked], biases


def gemm_group(a: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None] | None = None,
               *, b_transposed: bool = False, arch: str | None = None,
               config: TileConfig | dict | None = None) -> list[torch.Tensor]:
    """[a @ w + b for each weight w and bias b], the GEMMs in one kernel.

    a: (..., K); weights: two or three (K, N_g), or (N_g, K) with b_transposed=True (linear weights); biases:
    (N_g,) each, all or none. GPU: fp16/bf16 in one kernel (fp32 runs each weight's own `gemm`); cpu: fp32/fp64.
    `config`: a TileConfig to force (else the default / tuned one, tuned per group widths); `arch`: a variant.

    >>> import torch
    >>> from tkopt.kernels import gemm_group
    >>> x, wq, wk = torch.randn(2, 5, 32), torch.randn(24, 32), torch.randn(8, 32)
    >>> q, k = gemm_group(x, [wq, wk], b_transposed=True)
    >>> torch.allclose(q, x @ wq.T, atol=1e-5) and torch.allclose(k, x @ wk.T, atol=1e-5)
    True
    """
    forced = arch
    arch, M, K, ns, out_shapes, biases = _check(a, weights, biases, b_transposed, arch)
    precision = fp32_precision(arch, a.dtype)
    N = sum(ns)
    padded = _padded(arch, N, K, a.dtype, tuple(ns))
    Np, _, gp = padded
    if M == 0 or K == 0 or 0 in ns:  # nothing to compute, or zeros plus a bias: `gemm` handles the edges
        return [gemm(a, w, b, b_transposed=b_transposed, arch=forced) for w, b in zip(weights, biases, strict=True)]
    if config is not None:
        cfg = _resolve_config(config, arch, a.dtype, gated=False, precision=precision)
    else:
        def run(c):
            return median_ms(lambda: _launch(arch, c, a, weights, biases, b_transposed, M, K, ns, padded,
                                             out_shapes, precision))

        cfg = select_config("gemm_group", arch, M, Np, K, a.dtype, None, biases[0] is not None, False, b_transposed,
                            run, precision=precision, groups=gp)
    problem = group_problem(arch, Np, gp, cfg, cfg.math(arch, a.dtype, precision))
    if problem and config is not None:
        raise UnsupportedError(f"grouped GEMM: {problem}")
    if problem:
        return [gemm(a, w, b, b_transposed=b_transposed, arch=forced) for w, b in zip(weights, biases, strict=True)]
    return _launch(arch, cfg, a, weights, biases, b_transposed, M, K, ns, padded, out_shapes, precision)


def _launch(arch, cfg, a, weights, biases, b_transposed, M, K, ns, padded, out_shapes,
            precision) -> list[torch.Tensor]:
    """Run the grouped kernel on operands padded as `gemm_epilogue._launch` pads one weight (pad_operands);
    `padded`: _padded's (N, K, widths)."""
    Np, Kp, gp = padded
    a2, ws, bs = pad_operands(a.reshape(M, K), weights, biases, b_transposed, K, Kp, ns, gp)
    outs = [torch.empty((M, p), dtype=a.dtype, device=a.device) for p in gp]
    kern = compiled_kernel(arch, Np, Kp, a.dtype, cfg, b_transposed=b_transposed, has_bias=bs[0] is not None,
                           precision=precision, groups=gp)
    kern(a2.contiguous(), *(w.contiguous() for w in ws), *(b.contiguous() for b in bs if b is not None), *outs)
    return [(c if p == n else c[:, :n]).reshape(shape) for c, n, p, shape in zip(outs, ns, gp, out_shapes, strict=True)]


__all__ = ["gemm_group"]
