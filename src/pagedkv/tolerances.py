"""Tolerances per dtype, stated once: every numeric test and `pagedkv selfcheck` use this table."""

# (atol, rtol) of a kernel output against the float64 reference, by the dtype of the compared output.
TOLERANCES = {
    "float32": (1e-5, 1e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
    # Quantized caches, IN UNITS OF THE SCALE (compare x / scale): one rounding of the stored value.
    # e4m3: 3 mantissa bits -> relative half-step 2^-4 (1/16 = 0.0625); below 2^-6 (subnormals) the step is
    # absolute, 2^-9, so half of it, 2^-10, is the absolute term.
    "float8_e4m3fn": (2.0**-10 + 1e-9, 0.0625 + 1e-6),
    "int8": (0.5 + 1e-6, 0.0),  # rounding to the nearest integer
}
