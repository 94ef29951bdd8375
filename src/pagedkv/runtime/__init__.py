"""The runtime: rewritten graphs and their engines, run step by step over the KV manager's pools, scheduled
with continuous batching, sampled on the device, with a Python API and ``pagedkv generate``.

    from pagedkv.runtime import LLM, SamplingParams
    llm = LLM("model.paged.onnx", backend="reference")                  # or an engine file, backend="trt"
    outputs = llm.generate(["Hello"], SamplingParams(max_new_tokens=16))

Pieces, in the order data flows: ``graph`` (reading both graphs), ``executor`` (one interface; ``session``:
ONNX Runtime with the plugin ops over ``backends`` — numpy references or CUDA kernels — via ``ops``; ``trt``:
a TensorRT engine), ``sampling`` (parameters, seeded uniforms, penalties), ``request`` and ``scheduler``
(continuous batching, chunked prefill, prefix reuse, preemption), ``engine`` (one step: schedule -> execute ->
outputs), ``tokenizer`` (Hugging Face tokenizers, incremental detokenization), ``api`` (``LLM``, ``Worker``),
``generate`` (the CLI verb), ``loop`` (the fixed schedule ``compare`` drives both graphs with). Engine inputs
and outputs are ``pagedkv.engine_io``'s. ``docs/runtime.md`` explains the design.
"""

from pagedkv.runtime.api import (LLM, Completion, Delta, RequestHandle, Worker, WorkerBusy, WorkerClosed,  # noqa: F401
                                 open_executor)
from pagedkv.runtime.engine import Engine  # noqa: F401
from pagedkv.runtime.executor import Executor, SamplingInputs, StepInputs, StepOutputs  # noqa: F401
from pagedkv.runtime.graph import DecoderGraph, GraphError, RewrittenGraph  # noqa: F401
from pagedkv.runtime.request import ContextLengthError, FinishReason, Request  # noqa: F401
from pagedkv.runtime.sampling import SamplingParams  # noqa: F401
from pagedkv.runtime.scheduler import SchedulerConfig  # noqa: F401
from pagedkv.runtime.session import DenseSession, OrtExecutor  # noqa: F401
