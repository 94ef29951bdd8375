"""The reference runtime: rewritten graphs in ONNX Runtime with the pagedkv plugin ops as custom ops.

    from pagedkv.builder.runtime import PagedSession, DenseSession, Schedule, Request, generate
    with PagedSession("rewritten.onnx", backend="reference") as paged:      # numpy pools + references
        tokens = generate(paged, [prompt_a, prompt_b], max_new_tokens=8, chunk_size=16)

Pieces: ``graph`` (reading both graphs), ``ops`` (the onnxruntime-extensions PyOps), ``backends`` (numpy
references or CUDA kernels behind the ops), ``session`` (one step at a time, paged or dense), ``loop``
(continuous batching of prompts: chunked prefill then decode). ``docs/runtime.md`` explains the design.
"""

from pagedkv.builder.runtime.graph import DecoderGraph, GraphError, RewrittenGraph  # noqa: F401
from pagedkv.builder.runtime.loop import Request, Schedule, generate  # noqa: F401
from pagedkv.builder.runtime.session import DenseSession, PagedSession  # noqa: F401
