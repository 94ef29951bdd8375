"""compare with the CUDA backend: the rewritten graph in ONNX Runtime, plugin ops run by the CUDA kernels
through the C API on device pools owned by the KV manager (``storage="device"``).

Same cases as tests/test_compare.py, plus a bf16 cache. The kernels take fp16/bf16 activations (the
backend casts the float32 graph's qkv/q to the pool's 16-bit type), so the tolerance is
conftest.TOLERANCES["bfloat16"] on the logits' scale. Greedy tokens must agree. The K/V check reads host
pools, so it is done on the reference backend only; here the logits of every step carry it.
"""

from __future__ import annotations

import importlib.util

import pytest
from conftest import TOLERANCES

from pagedkv.builder.compare import compare
from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
from pagedkv.config import RopeConfig, RopeScaling, RopeStyle
from pagedkv.onnx_export import hf
from pagedkv.onnx_export.synthetic import SyntheticConfig, make_synthetic_model
from pagedkv.reference.rope import attention_factor

pytestmark = pytest.mark.gpu

BF16 = TOLERANCES["bfloat16"]
BASE = SyntheticConfig(num_layers=2, hidden=64, vocab=128, intermediate=128)
CASES = {
    "gqa-fp16": (BASE, "fp16"),
    "gqa-bf16": (BASE, "bf16"),
    "mqa-bias-fused": (BASE.replace(num_kv_heads=1, qkv_bias=True, fused_qkv=True), "fp16"),
    "gptj-partial-table": (BASE.replace(num_kv_heads=4, rope=RopeConfig(style=RopeStyle.GPTJ, rotary_dim=32),
                                        rope_source="table"), "fp16"),
    "window-qknorm": (BASE.replace(sliding_window=8, qk_norm=True), "bf16"),
    "d256": (BASE.replace(head_dim=256, num_heads=2, num_kv_heads=1), "fp16"),
    "d128-yarn-bias": (BASE.replace(head_dim=128, qkv_bias=True, rope=RopeConfig(
        scaling=RopeScaling.YARN, factor=4.0, original_max_positions=64)), "bf16"),
    # LongRoPE switching past kv length 12: prompts on both sides, the 5-token one crossing while decoding
    "longrope-partial": (BASE.replace(num_kv_heads=1, fused_qkv=True, rope=RopeConfig(
        scaling=RopeScaling.LONGROPE, rotary_dim=48, original_max_positions=12, factor=16.0,
        short_factors=tuple(1.0 + 0.03 * i for i in range(24)),
        long_factors=tuple(1.2 + 0.8 * i for i in range(24)))), "fp16"),
    "softcap-window-d256": (BASE.replace(head_dim=256, num_heads=2, num_kv_heads=1, logit_softcap=2.5,
                                         sliding_window=8), "bf16"),
    "d80-partial-rotary": (BASE.replace(head_dim=80, num_heads=2, num_kv_heads=2, rope=RopeConfig(rotary_dim=32)),
                           "fp16"),
    "d96-fused": (BASE.replace(head_dim=96, num_heads=2, num_kv_heads=1, fused_qkv=True), "bf16"),
    # YaRN and LongRoPE past 64 / 128: idle lanes of the write kernel's passes at D = 80 / 96
    "d80-yarn-gptj": (BASE.replace(head_dim=80, num_heads=2, num_kv_heads=1, rope=RopeConfig(
        style=RopeStyle.GPTJ, scaling=RopeScaling.YARN, factor=4.0, original_max_positions=64)), "bf16"),
    "d96-longrope-partial": (BASE.replace(head_dim=96, num_heads=2, num_kv_heads=1, fused_qkv=True, rope=RopeConfig(
        scaling=RopeScaling.LONGROPE, rotary_dim=40, original_max_positions=12, factor=16.0,
        short_factors=tuple(1.0 + 0.03 * i for i in range(20)),
        long_factors=tuple(1.2 + 0.8 * i for i in range(20)))), "fp16"),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("chunk", [0, 8])
def test_synthetic_cuda_backend(name, chunk):
    cfg, cache = CASES[name]
    model = make_synthetic_model(cfg)
    rewritten = rewrite_model(model, RewriteOptions(cache_dtype=cache)).model
    report = compare(model, rewritten, backend="cuda", prompt_lens=[5, 17, 33], decode_steps=8, chunk_size=chunk,
                     atol=BF16[0], rtol=BF16[1])
    assert report.logits_passed, str(report)
    assert report.greedy_passed, str(report)
    assert all(len(t) == 8 for t in report.greedy_tokens.values())


needs_export = pytest.mark.skipif(hf.why_export_unavailable() is not None,
                                  reason=f"export extra missing: {hf.why_export_unavailable()}")


def _cuda_compare(path):
    result = rewrite_model(str(path), RewriteOptions(cache_dtype="bf16"))
    # YaRN's and LongRoPE's attention factor multiplies q and k, so 16-bit rounding moves the scores by its square
    # (the tiny phi3's 1.58: measured 3.2e-2 of the logits' scale against BF16's 1.6e-2 on the H200)
    amplify = max(attention_factor(layer.rope) for layer in result.report.layers) ** 2
    report = compare(str(path), result.model, backend="cuda", prompt_lens=[5, 17, 33], decode_steps=8,
                     chunk_size=8, atol=BF16[0] * amplify, rtol=BF16[1] * amplify)
    assert report.logits_passed and report.greedy_passed, str(report)
    assert all(len(t) == 8 for t in report.greedy_tokens.values())


@needs_export
@pytest.mark.parametrize("family,attention", [*((f, "sdpa") for f in ("llama", "qwen2", "gemma", "gpt_neox")),
                                              *((f, "eager") for f in ("gpt2", "phi3", "qwen2_yarn", "gemma2"))])
def test_hf_cuda_backend(family, attention, tmp_path):
    """The dynamo exporter at opset 20: SDPA (transformers' and pagedkv export's default attention); eager for the
    families with a RoPE scaling, learned positions or the soft-cap (Gemma-2 has no SDPA in transformers)."""
    result = hf.export_hf(family, tmp_path / f"{family}.onnx", exporter="dynamo", attn_implementation=attention)
    _cuda_compare(result.path)


@needs_export
@pytest.mark.parametrize("exporter,opset", [("legacy", 17), ("dynamo", 23)])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_hf_sdpa_exports_cuda_backend(family, exporter, opset, tmp_path):
    """The other SDPA forms: the legacy exporter's decomposition (NaN guard) and opset 23's Attention op."""
    result = hf.export_hf(family, tmp_path / f"{family}.onnx", exporter=exporter, opset=opset,
                          attn_implementation="sdpa")
    _cuda_compare(result.path)


@needs_export
@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None, reason="onnxruntime-genai not installed")
def test_genai_packed_gqa_cuda_backend(tmp_path):
    """ONNX Runtime GenAI's model builder: GroupQueryAttention with packed QKV and RoPE inside."""
    from pagedkv.onnx_export.third_party import GENAI_VOCAB, export_genai, save_model_dir

    _cuda_compare(export_genai(save_model_dir("llama", tmp_path / "hf", vocab_size=GENAI_VOCAB), tmp_path / "genai"))
