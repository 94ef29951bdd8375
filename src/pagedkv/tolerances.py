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

# Whole graphs in reduced precision, by the dtype of their activations (weights and every op's result rounded to
# it): the logits and K/V of a 16-bit graph against the float32 model, relative to the output's scale,
# |got - expected| <= atol + rtol * max|expected| (pagedkv.builder.compare says why the scale). Used by `compare`
# (rewritten 16-bit graph vs its float32 original) and by the export's verification of a 16-bit export. One
# rounding is 2^-11 (fp16) / 2^-8 (bf16) relative; a logit of the tiny test models carries about 15-20 of them
# through two layers: the worst measured over the families and both exporters is 4.8e-3 (fp16) and 3.2e-2
# (bf16) of the scale (docs/builder.md, dtypes); the bounds leave 2x-2.5x.
MODEL_TOLERANCES = {
    "float32": TOLERANCES["float32"],
    "float16": (1e-2, 1e-2),
    "bfloat16": (8e-2, 8e-2),
}
# A float32 export against eager PyTorch, element-wise (|got - expected| <= atol + rtol * |expected|): kernel-order
# differences stay far below; a branch baked in by tracing (wrong mask, wrong cache length) gives errors of order 1.
EXPORT_FLOAT32_TOLERANCE = (1e-3, 1e-3)
