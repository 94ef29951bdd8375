"""Markers, each skip naming why: `gpu` tests skip without a CUDA device, `trt` tests without a TensorRT that can
run an engine on this GPU (pagedkv.runtime.trt.why_no_engine_runtime), `trt_builder` tests without a TensorRT
builder (TensorRT on a GPU, or TensorRT-RTX, which builds without one).

Tolerances per dtype are stated once, in pagedkv.tolerances (TOLERANCES, re-exported here).
"""

from __future__ import annotations

import pytest

from pagedkv import cuda

from pagedkv.tolerances import TOLERANCES  # noqa: E402,F401  (stated once, in the package)


def built_file(*names: str, how: str = "install pagedkv (`pip install .`) or set PAGEDKV_LIB_DIR to a build tree"):
    """The paths of files the build makes (pagedkv._lib names): CI builds them, so a missing one fails the test that
    needs it -- it is never skipped. One path for one name, else a tuple."""
    from pagedkv import _lib

    paths = [_lib.find_file(name) for name in names]
    if any(path is None for path in paths):
        pytest.fail(f"{' / '.join(names)} not found in {[str(d) for d in _lib.lib_dirs()]}: {how}")
    return str(paths[0]) if len(paths) == 1 else tuple(str(path) for path in paths)


def why_no_trt_builder() -> str | None:
    """None when an engine can be built here: TensorRT-RTX installed, or TensorRT and a GPU."""
    from pagedkv import trt_library

    if trt_library.why_unavailable(trt_library.TENSORRT_RTX) is None:
        return None
    if trt_library.why_unavailable(trt_library.TENSORRT) is None and cuda.why_no_gpu() is None:
        return None
    return (f"no TensorRT builder: {trt_library.why_unavailable(trt_library.TENSORRT_RTX)}; TensorRT needs a GPU as "
            "well")


_hf_exports: dict = {}
# (family, attention) -> why no exporter can produce the cell (test_export_hf.test_not_applicable_cells_still_are)
NOT_APPLICABLE = {("gemma2", "sdpa"): "transformers 5.24 refuses sdpa for Gemma-2 (_supports_sdpa = False: "
                                      "no logit soft-cap in torch's SDPA)"}


def hf_export(family: str, exporter: str, tmp_path_factory, opset: int | None = None, attention: str | None = None):
    """The family's tiny Hugging Face model (random weights) exported once per test session, shared by the modules
    that start from it (test_export_hf, test_engine_build). ``opset``: the exporter's default unless given;
    ``attention``: transformers' attention implementation (default: the export's, sdpa; eager where the family has
    no sdpa, NOT_APPLICABLE)."""
    from pagedkv.onnx_export import hf

    opset = opset or hf.DEFAULT_OPSET[exporter]
    attention = attention or ("eager" if (family, hf.DEFAULT_ATTENTION) in NOT_APPLICABLE else hf.DEFAULT_ATTENTION)
    key = (family, exporter, opset, attention)
    if key not in _hf_exports:
        path = tmp_path_factory.mktemp("hf") / f"{family}_{exporter}{opset}_{attention}.onnx"
        _hf_exports[key] = hf.export_hf(family, path, exporter=exporter, opset=opset, attn_implementation=attention,
                                        seed=0)
    return _hf_exports[key]


def pytest_collection_modifyitems(config, items):
    from pagedkv.runtime.trt import why_no_engine_runtime

    no_gpu = cuda.why_no_gpu()
    no_trt = why_no_engine_runtime()
    no_builder = why_no_trt_builder()
    for item in items:  # markers, not keywords: a parameter id "trt" is a keyword too
        if no_gpu and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=f"gpu: {no_gpu}"))
        if no_trt and item.get_closest_marker("trt"):
            item.add_marker(pytest.mark.skip(reason=f"trt: {no_trt}"))
        if no_builder and item.get_closest_marker("trt_builder"):
            item.add_marker(pytest.mark.skip(reason=f"trt_builder: {no_builder}"))


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
