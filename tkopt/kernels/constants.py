"""Float constants in TileLang programs, exact at the program's precision.

TileLang's C printer (the cpu programs) writes a float constant with 7 significant digits, float64 too:
1/sqrt(2) becomes 7.071068e-01, 5e-9 off, and a float32 can lose its last bit. Every kernel therefore
spells each float constant through `const`: a value those 7 digits reproduce (0, 0.5, 1e-5, 0.044715)
stays a plain literal, any other is rebuilt from its bit pattern (a reinterpreted int64, which every
printer writes exactly; nvcc folds it back into an immediate, as the PTX shows). A bare Python float in
a TIR expression is a constant printed the lossy way, so kernels never use one.
"""

from __future__ import annotations

import math

import numpy as np


def const(x: float, dtype: str):
    """`x` rounded to `dtype`, as a TIR constant that prints exactly (infinities as T.infinity)."""
    import tilelang.language as T  # lazily, as the kernel modules: importing tkopt.kernels needs no TileLang

    if dtype not in ("float32", "float64") or math.isnan(x):
        return T.cast(float(x), dtype)  # float16 / bfloat16 need fewer than 7 digits
    with np.errstate(over="ignore"):
        rounded = np.array(x, dtype)
    if np.isinf(rounded):
        return T.infinity(dtype) if rounded > 0 else -T.infinity(dtype)
    if np.array(f"{rounded.item():e}", dtype) == rounded:  # the 7-digit literal (C++'s std::scientific)
        return T.cast(rounded.item(), dtype)
    # The C printer takes the integer's address, which it can only do for an int64 (a literal int32 is
    # no lvalue); a float32 goes through its (exact) float64 value.
    wide = T.reinterpret(T.int64(np.array(rounded, "float64").view("int64").item()), "float64")
    return wide if dtype == "float64" else T.cast(wide, dtype)
