"""compare on synthetic decoders: original (ONNX Runtime, dense past) vs rewritten (reference runtime).

Every structure the synthetic generator emits goes through rewrite -> compare with a ragged batch of
prompts, whole and chunked prefill (mixed prefill/decode steps) and 8 greedy decode steps. Logits must be
within the tolerance of the pool's storage dtype (conftest.TOLERANCES["float16"] for the default fp16
cache, applied to the logits' scale: see pagedkv.builder.compare), every greedy token must agree, and the
K/V read back from the pools must equal the original's present K/V. Negative controls show that the
comparison fails when the rewritten graph is wrong (RoPE theta, window, softmax scale).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import TOLERANCES

from pagedkv.builder.compare import compare
from pagedkv.builder.rewrite import RewriteError, RewriteOptions, rewrite_model
from pagedkv.config import RopeConfig, RopeScaling, RopeStyle
from pagedkv.onnx_export.synthetic import SyntheticConfig, export_synthetic, make_synthetic_model

FP16 = TOLERANCES["float16"]
BASE = SyntheticConfig(num_layers=2, hidden=64, vocab=128, intermediate=128)
PROMPTS = [5, 17, 33]  # page 16: inside one page, across a page boundary, three pages

CASES = {
    "gqa": BASE,
    "mqa-bias-fused": BASE.replace(num_kv_heads=1, qkv_bias=True, fused_qkv=True),
    "mha-gptj-partial-table": BASE.replace(num_kv_heads=4, rope=RopeConfig(style=RopeStyle.GPTJ, rotary_dim=32),
                                           rope_source="table"),
    "window-qknorm-sqrtqk": BASE.replace(sliding_window=8, qk_norm=True, scale_mode="sqrt_qk"),
    "d128-llama3": BASE.replace(head_dim=128, rope=RopeConfig(scaling=RopeScaling.LLAMA3, factor=8.0,
                                                              original_max_positions=64)),
    "d256-mqa": BASE.replace(head_dim=256, num_heads=2, num_kv_heads=1),
    # head dims outside 64/128/256: Phi-2's 80 with partial rotary (32 of 80), Phi-3-mini's 96 (fused QKV), 32
    "d80-partial-rotary": BASE.replace(head_dim=80, num_heads=2, num_kv_heads=2, rope=RopeConfig(rotary_dim=32)),
    "d96-fused": BASE.replace(head_dim=96, num_heads=2, num_kv_heads=1, fused_qkv=True),
    "d32-gptj": BASE.replace(head_dim=32, rope=RopeConfig(style=RopeStyle.GPTJ)),
    "contrib-rotary": BASE.replace(attention_form="contrib_rotary"),
    "contrib-gqa": BASE.replace(attention_form="contrib_gqa"),
    "onnx23": BASE.replace(attention_form="onnx23"),
    "d128-yarn-bias": BASE.replace(head_dim=128, qkv_bias=True, rope=RopeConfig(
        scaling=RopeScaling.YARN, factor=4.0, original_max_positions=64, beta_fast=16.0)),
    "onnx23-yarn-given-factor": BASE.replace(attention_form="onnx23", rope=RopeConfig(
        scaling=RopeScaling.YARN, factor=8.0, original_max_positions=256, attention_factor=1.5)),
    "d80-yarn-gptj": BASE.replace(head_dim=80, num_heads=2, num_kv_heads=1, rope=RopeConfig(
        style=RopeStyle.GPTJ, scaling=RopeScaling.YARN, factor=4.0, original_max_positions=64)),
}
# LongRoPE switching past kv length 12: the prompts (5, 17, 33) start on both sides of it, and the 5-token one
# crosses it while decoding.
def _longrope(rotary_dim: int) -> RopeConfig:
    pairs = rotary_dim // 2
    return RopeConfig(scaling=RopeScaling.LONGROPE, rotary_dim=rotary_dim, original_max_positions=12, factor=16.0,
                      short_factors=tuple(1.0 + 0.03 * i for i in range(pairs)),
                      long_factors=tuple(1.2 + 0.8 * i for i in range(pairs)))


LONGROPE = BASE.replace(num_kv_heads=1, fused_qkv=True, rope=_longrope(48))
# and at Phi-3-mini's head dim 96 with 40 of 96 dims rotating (R / 2 = 20: the write kernel's shared-memory partners)
LONGROPE_D96 = LONGROPE.replace(head_dim=96, num_heads=2, rope=_longrope(40))


def _run(original, rewritten, **kw):
    kw.setdefault("prompt_lens", PROMPTS)
    kw.setdefault("decode_steps", 8)
    return compare(original, rewritten, atol=FP16[0], rtol=FP16[1], **kw)


def _assert_passed(report, decode_steps=8, prompts=PROMPTS):
    assert report.logits_passed, str(report)
    assert report.greedy_passed, str(report)
    assert report.kv and report.kv_passed, str(report)
    tokens = report.greedy_tokens
    assert sorted(tokens) == [f"s{i}" for i in range(len(prompts))]
    assert all(len(t) == decode_steps for t in tokens.values()), tokens
    assert report.passed


@pytest.mark.parametrize("name", list(CASES))
def test_synthetic_structures_match(name):
    model = make_synthetic_model(CASES[name])
    rewritten = rewrite_model(model, RewriteOptions()).model
    whole = _run(model, rewritten, chunk_size=0)
    _assert_passed(whole)
    chunked = _run(model, rewritten, chunk_size=8)
    _assert_passed(chunked)
    # chunked prefill really mixed prefill chunks with decode tokens in one step
    kinds = [{k for _, _, k in s.entries} for s in chunked.steps]
    assert {"prefill", "decode"} in kinds
    # both schedules feed the original's greedy tokens; the model is the same, so the tokens are too
    assert whole.greedy_tokens == chunked.greedy_tokens


@pytest.mark.parametrize("cfg", [LONGROPE, LONGROPE_D96], ids=["d64-r48", "d96-r40"])
def test_longrope_switches_per_sequence_like_the_original(cfg):
    """Each step of each sequence takes the table of its kv length (the original graph runs one sequence per step
    with its dense past, as transformers' longrope update does): whole and chunked prefill both match. (Chunking
    changes which steps are long, so unlike the other structures their greedy tokens may differ.)"""
    model = make_synthetic_model(cfg)
    result = rewrite_model(model, RewriteOptions())
    rope = result.report.layers[0].rope
    assert (rope.scaling, rope.original_max_positions, rope.rotary_dim) == \
        (RopeScaling.LONGROPE, 12, cfg.rope.rotary_dim)
    for chunk in (0, 8):
        report = _run(model, result.model, chunk_size=chunk)
        _assert_passed(report)
    # the switch is load-bearing: one kv length later, compare fails
    for node in result.model.graph.node:
        for attr in node.attribute:
            if attr.name == "rope_original_max_positions":
                attr.i = 13
    assert not _run(model, result.model, chunk_size=8).logits_passed


def test_windowed_pool_releases_pages_and_still_matches():
    cfg = BASE.replace(sliding_window=8)
    model = make_synthetic_model(cfg)
    rewritten = rewrite_model(model, RewriteOptions(page_size=16)).model
    report = _run(model, rewritten, prompt_lens=[40, 23], chunk_size=16, decode_steps=9)
    _assert_passed(report, decode_steps=9, prompts=[40, 23])
    # pages wholly outside the window were released: fewer positions resident than the sequence length
    assert min(k.positions for k in report.kv) < 40 + 9


def _set_attr(model, op_type, name, value):
    out = onnx.ModelProto()
    out.CopyFrom(model)
    hit = 0
    for node in out.graph.node:
        if node.op_type == op_type:
            for attr in node.attribute:
                if attr.name == name:
                    if attr.type == onnx.AttributeProto.FLOAT:
                        attr.f = value
                    else:
                        attr.i = value
                    hit += 1
    assert hit, f"no {op_type}.{name} attribute to change"
    return out


@pytest.mark.parametrize("op_type,attr,value,what", [
    ("PagedKVQKVWrite", "rope_theta", 20000.0, "RoPE theta doubled"),
    ("PagedKVAttention", "window", 4, "a window the model does not have"),
    ("PagedKVAttention", "softmax_scale", 0.2, "softmax scale 0.2 instead of 1/8"),
])
def test_compare_fails_on_a_wrong_rewrite(op_type, attr, value, what):
    model = make_synthetic_model(BASE)
    broken = _set_attr(rewrite_model(model, RewriteOptions()).model, op_type, attr, value)
    report = _run(model, broken, chunk_size=8)
    assert not report.passed, f"{what}: compare did not notice\n{report}"
    assert not report.logits_passed
    # errors of the order of the logits, far beyond the tolerance
    assert max(s.max_scaled for s in report.steps) > 10 * FP16[1], str(report)


def test_report_is_readable():
    model = make_synthetic_model(BASE)
    rewritten = rewrite_model(model, RewriteOptions()).model
    text = str(_run(model, rewritten, chunk_size=8, decode_steps=2))
    assert "PASSED" in text and "s2:p8" in text and "s0:d1" in text and "paged K/V vs present K/V" in text


def test_cli_compare_and_rewrite(tmp_path, capsys):
    from pagedkv.cli import main

    orig = export_synthetic(BASE, tmp_path / "orig.onnx")
    rew = tmp_path / "rew.onnx"
    assert main(["rewrite", str(orig), "-o", str(rew)]) == 0
    assert rew.is_file()
    code = main(["compare", str(orig), str(rew), "--prompt-lens", "5,17", "--decode-steps", "8",
                 "--chunk-size", "8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASSED" in out
    broken = tmp_path / "broken.onnx"
    onnx.save(_set_attr(onnx.load(str(rew)), "PagedKVQKVWrite", "rope_theta", 500.0), str(broken))
    assert main(["compare", str(orig), str(broken), "--prompt-lens", "5,17", "--decode-steps", "2"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_cli_rewrite_reports_unrecognized_graph(tmp_path, capsys):
    from onnx import TensorProto, helper

    from pagedkv.cli import main

    # a graph with a past-KV-like input but no attention: the rewrite must refuse with a precise message
    past = helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, ["b", 2, "p", 64])
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])
    out = helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT, ["b", 2, "p", 64])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 4])
    nodes = [helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"], name="copy_past"),
             helper.make_node("Cast", ["input_ids"], ["f"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Unsqueeze", ["f", "axes"], ["u"], name="unsq"),
             helper.make_node("Expand", ["u", "shape"], ["logits"], name="expand")]
    inits = [helper.make_tensor("axes", TensorProto.INT64, [1], [2]),
             helper.make_tensor("shape", TensorProto.INT64, [3], [1, 1, 4])]
    model = helper.make_model(helper.make_graph(nodes, "no_attention", [ids, past], [logits, out], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "no_attention.onnx"
    onnx.save(model, str(path))
    with pytest.raises(RewriteError):
        rewrite_model(model, RewriteOptions())
    assert main(["rewrite", str(path), "-o", str(tmp_path / "x.onnx")]) == 1
    err = capsys.readouterr().err
    assert "pagedkv rewrite:" in err and len(err.strip()) > len("pagedkv rewrite:") + 10
    assert not (tmp_path / "x.onnx").exists()


def test_prompts_are_ragged_and_reproducible():
    from pagedkv.builder.compare import make_prompts

    a = make_prompts(3, None, 128, seed=3)
    b = make_prompts(3, None, 128, seed=3)
    assert [len(p) for p in a] == [5, 17, 33]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="prompt_lens"):
        make_prompts(3, [4, 5], 128, seed=0)


def test_sample_script_runs(tmp_path, capsys):
    import runpy
    from pathlib import Path

    sample = Path(__file__).resolve().parents[1] / "samples" / "python" / "build_and_compare.py"
    main = runpy.run_path(str(sample))["main"]
    assert main(["--synthetic", "--out-dir", str(tmp_path), "--decode-steps", "2", "--chunk-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "rewrote 2 attention layer(s)" in out and "PASSED" in out
    assert (tmp_path / "rewritten.onnx").is_file()


@pytest.mark.parametrize("backend", ["cuda", "trt"])
def test_cli_compare_names_an_unavailable_backend(backend, tmp_path, capsys):
    from pagedkv import cuda
    from pagedkv.cli import main
    from pagedkv.runtime.trt import why_no_engine_runtime

    reason = cuda.why_no_gpu() if backend == "cuda" else why_no_engine_runtime()
    if reason is None:
        pytest.skip(f"the {backend} backend is available here: the unavailable-backend path cannot be observed")
    expected = "cuda backend unavailable" if backend == "cuda" else reason
    orig = export_synthetic(BASE, tmp_path / "orig.onnx")
    rew = tmp_path / "rew.onnx"
    onnx.save(rewrite_model(str(orig), RewriteOptions()).model, str(rew))
    assert main(["compare", str(orig), str(rew), "--backend", backend]) == 2
    assert expected in capsys.readouterr().err
