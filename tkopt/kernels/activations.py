"""The epilogue activations of the GEMM and conv kernels as TIR expressions (semantics: reference.apply_activation).

Each is written in the accumulator dtype. float32's exact GELU is not erff but one exp2 of a polynomial fit
(`_gelu_fp32`): in a GEMM epilogue the activation is most of the instructions each output element costs.
"""

import functools
import math

from .arch import UnsupportedError
from .constants import const
from .reference import ACTIVATIONS

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
# log2 Phi(-y) for y in [0, _GELU_TAIL] (Phi: the standard normal CDF) as -1 + y Q(y), lowest power first: a
# least-squares Chebyshev fit, its coefficients rounded to float32 (within 4.3e-7 of log2 Phi(-y) then).
# Phi(-5.5) = 1.9e-8, so 1 - Phi(-y) rounds to 1 in float32 from there on.
_LOG2_PHI_NEG = (
    -1.0, -1.1511105298995972, -0.459166944026947, -0.052596207708120346, 0.007161410991102457,
    -0.00016469895490445197, -0.00020477639918681234, 5.585023245657794e-05, -7.603468930028612e-06,
    5.594866365754569e-07, -1.7659317563811783e-08,
)
# The same form at degree 6, for results rounded to 16 bits: within 1.0e-4 of log2 Phi(-y), the GELU within
# 2.8e-5 relative, under a thirtieth of an fp16 unit; four FFMAs an element fewer.
_LOG2_PHI_NEG_16 = (
    -1.0, -1.1507643461227417, -0.46002092957496643, -0.052202191203832626, 0.007571907714009285,
    -0.0006751810433343053, 2.706477971514687e-05,
)
_GELU_TAIL = 5.5
_SHORT_OUTPUTS = ("float16", "bfloat16")


def _gelu_fp32(x, coeffs: tuple[float, ...], cuda: bool):
    """Exact (erf) GELU x Phi(x) in float32 from one exp2: Phi(-|x|) = 2^P(|x|) with P a fit above (`coeffs`),
    Phi(x) = 1 - Phi(-x) for x >= 0 and 0 below -_GELU_TAIL (where float32's 1 + erf(x / sqrt 2) is 0 too; -inf
    gives NaN, as eager). erff's two-range polynomial takes 26 SASS instructions an element, most of a GEMM
    epilogue's; this 20 at degree 10 and 15 at degree 6 with fabsf (benchmarks/results/2026-12-07-g), branch-free,
    so that the compiler interleaves elements (BERT-base's 8192x3072x768 + GELU on the H200, degree 10: 89 -> 84
    us; 2026-12-07-h200). Error at degree 10: 6e-7 absolute at most, 3e-7 relative near 0, under float32 erff's own
    (1.2e-6 absolute). On CUDA |x| is fabsf, which the min takes as an operand modifier; the C backend has no fabs."""
    import tilelang.language as T

    f32 = functools.partial(const, dtype="float32")
    y = T.min(T.abs(x) if cuda else T.max(x, -x), f32(_GELU_TAIL))  # NaN gives the tail
    p = f32(coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p = p * y + f32(c)
    # Phi = s + k 2^p, with s and k selects of constants: a select of the exp2 itself becomes a branch
    pos = x >= f32(0.0)
    s = T.Select(pos, f32(1.0), f32(0.0))
    k = T.Select(pos, f32(-1.0), T.Select(x < f32(-_GELU_TAIL), f32(0.0), f32(1.0)))
    return x * (s + k * T.exp2(p))


def activation(x, act: str | None, acc: str, out_dtype: str | None = None, *, cuda: bool = False):
    """`act` (reference.ACTIVATIONS' names; "none" is None) on `x`, a TIR expression of the accumulator dtype `acc`.
    `out_dtype` (default `acc`): what the result is rounded to, before or after a gate or a residual; a 16-bit one
    takes float32's shorter GELU fit. `cuda`: the kernel is CUDA source, not the C backend's."""
    import tilelang.language as T

    if act is None or act == "none":
        return x
    one = const(1.0, acc)
    half = const(0.5, acc)
    if act == "relu":  # torch.relu keeps NaN (and -0.0); max(x, 0) is fmaxf on CUDA, a compare in C: both give 0
        return T.Select(x < const(0.0, acc), const(0.0, acc), x)
    if act == "gelu" and acc == "float32":
        return _gelu_fp32(x, _LOG2_PHI_NEG_16 if out_dtype in _SHORT_OUTPUTS else _LOG2_PHI_NEG, cuda)
    if act == "gelu":
        return half * x * (one + T.erf(x * const(_INV_SQRT2, acc)))
    if act == "gelu_tanh":
        inner = const(_SQRT_2_OVER_PI, acc) * (x + const(0.044715, acc) * x * x * x)
        return half * x * (one + T.tanh(inner))
    if act == "silu":
        return x / (one + T.exp(-x))
    if act == "sigmoid":
        return one / (one + T.exp(-x))
    raise UnsupportedError(f"act: unknown activation {act!r}; expected one of {ACTIVATIONS}")
