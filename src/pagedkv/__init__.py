"""pagedkv: TensorRT plugins and a Python builder toolkit for LLM inference with a paged KV cache.

Data flow, one module each: ``onnx_export`` (model -> ONNX) -> ``builder`` (find attention, rewrite into the
plugin nodes, build engines, compare) -> runtime (``kvcache`` pools and page tables, ``reference`` numpy
references, ``kernels`` the CUDA kernels through the C API).
"""

__version__ = "0.1.0"

from pagedkv.layout import INVALID_BLOCK, CacheDType, KVLayout, PageLayout  # noqa: E402,F401
