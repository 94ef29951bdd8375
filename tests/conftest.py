"""Markers: `gpu` tests skip without a CUDA device and `trt` tests without TensorRT, each naming why.

Tolerances per dtype are stated once, in pagedkv.tolerances (TOLERANCES, re-exported here).
"""

from __future__ import annotations

import importlib.util

import pytest

from pagedkv import cuda

from pagedkv.tolerances import TOLERANCES  # noqa: E402,F401  (stated once, in the package)


def _trt_missing() -> str | None:
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT Python runtime not installed (it is not installable in this workplace)"
    return None


def pytest_collection_modifyitems(config, items):
    no_gpu = cuda.why_no_gpu()
    no_trt = _trt_missing()
    for item in items:
        if no_gpu and "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"gpu: {no_gpu}"))
        if no_trt and "trt" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"trt: {no_trt}"))


# ---- the exporter matrix (tests/test_export_hf.py, tests/test_exporters.py) ---------------------------------
MATRIX_PROMPTS = [5, 17, 33]  # ragged: inside one page, across a page boundary, three pages (page 16)


def rewrite_and_compare(path, label: str):
    """One cell of the exporter matrix: ``rewrite_model`` the exported graph, then ``compare`` it with the original
    on a ragged batch (MATRIX_PROMPTS) in 8-token prefill chunks (steps mix prefill chunks and decodes) and 8 greedy
    decode steps: logits within the fp16-cache tolerance on the logits' scale, every greedy token the same, the
    paged K/V equal to the present K/V; then the logits heads (``check_heads``). Returns the RewriteResult."""
    import time

    from pagedkv.builder.compare import compare
    from pagedkv.builder.rewrite import RewriteOptions, rewrite_model

    result = rewrite_model(str(path), RewriteOptions())
    start = time.perf_counter()
    fp16 = TOLERANCES["float16"]
    report = compare(str(path), result.model, prompt_lens=MATRIX_PROMPTS, decode_steps=8, chunk_size=8,
                     atol=fp16[0], rtol=fp16[1])
    print(f"{label}: compare {time.perf_counter() - start:.1f} s, max abs {report.max_abs:.2e}")
    assert report.logits_passed, str(report)
    assert report.greedy_passed, str(report)
    assert report.kv and report.kv_passed, str(report)
    assert {"prefill", "decode"} in [{k for _, _, k in s.entries} for s in report.steps]
    assert all(len(t) == 8 for t in report.greedy_tokens.values())
    check_heads(result.model)
    return result


def check_heads(model, prompt_len: int = 13, rows=(12, 3, 0)):
    """The heads the rewrite put on ``model`` (``pagedkv.builder.logits_head``), on one prompt: the logits of some
    rows (gathered before the LM head, or on the logits where no LM head is recognizable) equal those rows of the
    logits of every row, and the sampling head's greedy pick of each row is its argmax, with its log-softmax as
    the logprob."""
    import numpy as np

    from pagedkv.runtime import OrtExecutor, SamplingInputs, StepInputs

    with OrtExecutor(model, num_blocks=8) as ex:
        assert ex.graph.sampling, "the rewrite emits the sampling head by default"
        prompt = np.random.default_rng(0).integers(0, ex.graph.vocab, prompt_len)
        outs = []
        for seq, step_rows, sampling in (("every", np.arange(prompt_len), None),
                                         ("some", np.asarray(rows), SamplingInputs.greedy(len(rows)))):
            ex.manager.add_sequence(seq)
            ex.manager.reserve(seq, prompt_len)
            batch = ex.manager.build_step([(seq, prompt_len)])
            outs.append(ex.execute(StepInputs(batch, prompt, step_rows.astype(np.int32), sampling, want_logits=True)))
    every, some = outs
    np.testing.assert_allclose(some.logits, every.logits[list(rows)], rtol=1e-5, atol=1e-5)
    logits = some.logits.astype(np.float64)
    np.testing.assert_array_equal(some.next_tokens, np.argmax(logits, -1))
    log_softmax = logits - logits.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    np.testing.assert_allclose(some.next_logprobs, log_softmax[np.arange(len(rows)), some.next_tokens],
                               rtol=1e-4, atol=1e-4)
