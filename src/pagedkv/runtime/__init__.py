"""The runtime: rewritten graphs and their engines, run step by step over the KV manager's pools.

    from pagedkv.runtime import PagedSession, DenseSession, Schedule, Request, generate
    with PagedSession("rewritten.onnx", backend="reference") as paged:      # numpy pools + references
        tokens = generate(paged, [prompt_a, prompt_b], max_new_tokens=8, chunk_size=16)

Pieces: ``graph`` (reading both graphs), ``ops`` (the onnxruntime-extensions PyOps), ``backends`` (numpy
references or CUDA kernels behind the ops), ``session`` (one step at a time, paged or dense), ``trt`` (a
TensorRT engine with the same step API), ``loop`` (continuous batching of prompts: chunked prefill then
decode). Engine inputs and outputs are ``pagedkv.engine_io``'s. ``docs/runtime.md`` explains the design.
"""

from pagedkv.runtime.graph import DecoderGraph, GraphError, RewrittenGraph  # noqa: F401
from pagedkv.runtime.loop import Request, Schedule, generate  # noqa: F401
from pagedkv.runtime.session import DenseSession, PagedSession  # noqa: F401
