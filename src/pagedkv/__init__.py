"""pagedkv: TensorRT plugins, a Python builder toolkit and a runtime for LLM inference with a paged KV cache.

Data flow, one subpackage each: ``onnx_export`` (model -> ONNX) -> ``builder`` (find attention, rewrite into
the plugin nodes, compare, build engines) -> ``runtime`` (run a rewritten graph or its engine step by step).
Under them the core: ``engine_io`` (the rewritten graph's inputs and outputs), ``config`` / ``pool_group`` /
``layout`` / ``step`` (the plugins' attributes, pool groups, the KV layout, step metadata), ``kvcache`` (pools
and page tables), ``reference`` (float64 numpy references), ``kernels`` (the CUDA kernels through the C API).
Source trees: ``builder/X`` is ``pagedkv.builder.X``, ``onnx_export/X`` is ``pagedkv.onnx_export.X``,
everything else is ``src/pagedkv/X``.
"""

__version__ = "0.1.0"

from pagedkv.layout import INVALID_BLOCK, CacheDType, KVLayout, PageLayout  # noqa: E402,F401
