"""The engine on the CUDA-kernel executor (``OrtExecutor(backend="cuda")``: device pools, the kernels through the
C API): the Hugging Face scenario of tests/test_runtime_hf.py (ragged, chunked, mid-stream, shared prefix)
against ``model.generate`` in float32, within the fp16 / bf16 cache's tolerance (ties reported as ties), and the
synthetic decoder against the reference executor's tokens, sampled ones included (same seeds).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOLERANCES
from runtime_support import SMALL, compared_total, hf_scenario, synthetic_rewritten

from pagedkv.onnx_export import hf
from pagedkv.runtime import Engine, OrtExecutor, SamplingParams, SchedulerConfig

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(hf.why_export_unavailable() is not None, reason=f"export extra missing: "
                                                                     f"{hf.why_export_unavailable()}")
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "gpt_neox", "mistral"])
@pytest.mark.parametrize("cache", ["fp16", "bf16"])
def test_cuda_engine_greedy_equals_hf_generate(family, cache, tmp_path):
    tolerance = TOLERANCES["bfloat16"]  # the kernels take 16-bit activations, whatever the cache dtype
    compared, ties = hf_scenario(family, tmp_path, backend="cuda", tolerance=tolerance, cache_dtype=cache)
    assert compared >= 0.7 * compared_total(), (compared, ties)


def test_cuda_engine_follows_the_reference_engine():
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, SMALL.vocab, n) for n in (5, 17, 33, 12)]
    params = [SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=8, temperature=0.7, seed=3)]
    outs = {}
    for backend in ("reference", "cuda"):
        with OrtExecutor(synthetic_rewritten(SMALL), backend=backend, num_blocks=64) as ex:
            engine = Engine(ex, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, chunk_size=8))
            reqs = [engine.add_request((i, j), p, sp) for i, p in enumerate(prompts) for j, sp in enumerate(params)]
            engine.run()
            outs[backend] = [r.output for r in reqs]
    same = sum(a == b for a, b in zip(outs["reference"], outs["cuda"]))
    assert same >= len(prompts), (outs, "the 16-bit kernels may flip near-ties; most requests must agree")
