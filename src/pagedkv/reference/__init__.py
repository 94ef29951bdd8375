"""float64 numpy references of the write path and the read path: the contract's executable spec.

Written for clarity (TensorRT-LLM ``vanilla.py`` in spirit): every pool address goes through
``pagedkv.layout.KVLayout``. The CUDA kernel tests, the KV manager tests and the builder's reference runtime
all compare against these. ``docs/references.md`` states the conventions and how the tests prove them.

    rope       rope_inv_freq, apply_rope            RoPE styles (NEOX, GPTJ), scaling (linear, llama3, yarn,
                                                    longrope), attention factor
    quant      quantize, dequantize                 pool storage convention (cache_convert.cuh)
    write      qkv_write, InvalidPageError          bias + RoPE + quantize + paged write + V tail zeroing
    attention  paged_attention, dense_attention     paged read (GQA, window + sinks, softcap), dense twin
    sampling   sampling_head, keep_mask             the graph's sampling head: penalties, masks, inverse CDF
"""

from pagedkv.reference.attention import dense_attention, paged_attention
from pagedkv.reference.quant import dequantize, quantize
from pagedkv.reference.rope import apply_rope, rope_inv_freq
from pagedkv.reference.write import InvalidPageError, qkv_write

__all__ = ["rope_inv_freq", "apply_rope", "quantize", "dequantize", "InvalidPageError", "qkv_write",
           "paged_attention", "dense_attention"]
