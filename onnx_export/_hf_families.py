"""Tiny Hugging Face configurations, one per supported family, built in code (never from the hub).

Each is a real decoder of its family (same modules, same attention code path), shrunk to 2 layers, a
hidden size of 64-128 and a 128-token vocabulary so that export and ONNX Runtime take seconds on a CPU.
Head dims stay within the kernels' set (``pagedkv.capabilities``: 64, 128, 256 today); families whose head
dim is ``hidden / heads`` use hidden 128 with 2 heads. Parameters that matter for the attention rewrite are deliberately
non-default: GQA, partial rotary, QKV bias, a short sliding window, q/k norms, head dim 256, RoPE scalings
whose switch or ramp falls inside the test's lengths (LongRoPE past 12 tokens, YaRN over an original context
of 64), a soft-cap small enough to bend the scores, learned absolute positions.

``randomize_weights`` replaces the transformers initialisation (std 0.02, zero biases, unit norms), under
which attention is nearly uniform and biases are zero, so that a wrong RoPE, a dropped bias or a wrong
window would not show in the logits. Here scores have unit-order spread and every bias and norm weight is
non-trivial.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

VOCAB = 128
LAYERS = 2
MAX_POSITIONS = 512


@dataclass(frozen=True)
class Family:
    name: str
    config_class: str  # attribute of the transformers module
    make_kwargs: Callable[[], dict]
    notes: str  # what the family exercises in the rewrite


def _llama():
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False)


def _mistral():
    # A window shorter than the test prompts, so that sliding-window masking is really exercised.
    return dict(_llama(), sliding_window=8)


def _qwen2():
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                head_dim=64, tie_word_embeddings=False, use_sliding_window=False)


def _qwen3():
    return dict(_qwen2(), attention_bias=False)


def _gpt_neox():
    return dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                num_attention_heads=2, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def _gptj():
    return dict(vocab_size=VOCAB, n_embd=128, n_inner=256, n_layer=LAYERS, n_head=2, rotary_dim=32,
                n_positions=MAX_POSITIONS, tie_word_embeddings=False)


def _phi():
    return dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def _gemma():
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True, pad_token_id=0)


def _gpt2():
    # Conv1D projections (x @ W + b: addmm, a Gemm in the legacy export), one fused c_attn with bias, learned
    # absolute position embeddings (wpe) gathered by position_ids, no RoPE.
    return dict(vocab_size=VOCAB, n_embd=128, n_inner=256, n_layer=LAYERS, n_head=2, n_positions=MAX_POSITIONS,
                tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                eos_token_id=0)


# LongRoPE's switch point, tiny so that the test prompts (5, 17, 33 tokens) sit on both sides of it.
PHI3_ORIGINAL_MAX_POSITIONS = 12


def _phi3():
    # Per-dimension short/long factors of unit order and visibly different, so that using the wrong table (or
    # switching at the wrong length) shows in the logits. factor = 512 / 12 gives HF's default attention factor
    # sqrt(1 + ln(factor) / ln(12)) = 1.58.
    rotary_pairs = 32  # head_dim 64
    short = [round(1.0 + 0.05 * i, 4) for i in range(rotary_pairs)]
    long = [round(1.5 + 0.4 * i, 4) for i in range(rotary_pairs)]
    return dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=MAX_POSITIONS,
                original_max_position_embeddings=PHI3_ORIGINAL_MAX_POSITIONS, tie_word_embeddings=False,
                sliding_window=None, pad_token_id=0,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
                                 "long_factor": long,
                                 "original_max_position_embeddings": PHI3_ORIGINAL_MAX_POSITIONS})


def _qwen2_yarn():
    # Qwen2.5's long-context recipe (rope_scaling yarn, factor 4 over the original context), on a small original
    # context so that the ramp between the extrapolated and the interpolated dims falls inside head_dim 64.
    return dict(_qwen2(), rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                           "beta_slow": 1.0})


def _gemma2():
    # Alternating sliding/full layers (window 8, shorter than the prompts), an attention logit soft-cap of 3 (scores
    # here have unit-order spread, so the cap bends them visibly; Gemma-2 ships 50) and a
    # query_pre_attn_scalar other than head_dim (softmax scale 1/sqrt(128) for head_dim 256).
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=2, num_key_value_heads=1, head_dim=256, max_position_embeddings=MAX_POSITIONS,
                sliding_window=8, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=128,
                attn_logit_softcapping=3.0, final_logit_softcapping=30.0, tie_word_embeddings=True, pad_token_id=0)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "LlamaConfig", _llama, "GQA 4/2, rotate-half RoPE, separate q/k/v"),
    Family("mistral", "MistralConfig", _mistral, "GQA, sliding window 8"),
    Family("qwen2", "Qwen2Config", _qwen2, "GQA, QKV bias"),
    Family("qwen3", "Qwen3Config", _qwen3, "GQA, q/k RMSNorm before RoPE"),
    Family("gpt_neox", "GPTNeoXConfig", _gpt_neox, "fused QKV with bias, partial rotary 25%"),
    Family("gptj", "GPTJConfig", _gptj, "interleaved rotary on 32 of 64 dims, position-indexed sin/cos table"),
    Family("phi", "PhiConfig", _phi, "partial rotary 50%, QKV bias, parallel attention/MLP"),
    Family("gemma", "GemmaConfig", _gemma, "MQA, head_dim 256, tied embeddings"),
    Family("gpt2", "GPT2Config", _gpt2, "Conv1D (Gemm) fused c_attn with bias, learned absolute positions, no RoPE"),
    Family("phi3", "Phi3Config", _phi3, "fused qkv_proj, GQA, LongRoPE short/long factors switching at 12 tokens"),
    Family("qwen2_yarn", "Qwen2Config", _qwen2_yarn, "YaRN scaling (factor 4, beta 32/1) with its attention factor"),
    Family("gemma2", "Gemma2Config", _gemma2, "attention logit soft-cap, alternating sliding-window layers"),
)}


def tiny_config(family: str, **overrides):
    """The family's tiny ``transformers`` config (eager attention unless ``attn_implementation`` is given)."""
    import transformers

    try:
        fam = FAMILIES[family]
    except KeyError:
        raise ValueError(f"family: unknown value {family!r}; expected one of {sorted(FAMILIES)}") from None
    kwargs = fam.make_kwargs()
    kwargs.update(overrides)
    return getattr(transformers, fam.config_class)(**kwargs)


def _is_norm(name: str) -> bool:
    leaf = name.lower()
    return any(tag in leaf for tag in ("norm", "ln_", ".ln", "layernorm"))


def randomize_weights(model, seed: int) -> None:
    """Deterministic weights with unit-order attention scores (see the module docstring).

    Linear weights ~ N(0, 1/fan_in) scaled so that q.k/sqrt(D) has a spread of about 1-2 (GPT-2's Conv1D
    keeps its weight as [in, out]: its fan-in is the first axis); token and position embeddings ~ N(0, 1);
    biases ~ N(0, 0.1); norm weights ~ 1 + N(0, 0.1) (Gemma's (1 + w) norms get w ~ N(0, 0.1)).
    Buffers (inv_freq, masks) are left as the model built them.
    """
    import torch

    gen = torch.Generator().manual_seed(int(seed))
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            owner = modules.get(name.rpartition(".")[0])
            if _is_norm(name):
                base = 0.0 if "gemma" in type(model).__name__.lower() else 1.0
                noise = torch.randn(param.shape, generator=gen) * 0.1
                param.copy_(base + noise if name.endswith("weight") else noise)
            elif param.ndim == 1:  # bias
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            elif "embed" in name or "wte" in name or "wpe" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:  # Linear [out, in], Conv1D [in, out]
                fan_in = param.shape[0 if type(owner).__name__ == "Conv1D" else -1]
                param.copy_(torch.randn(param.shape, generator=gen) * (1.4 / math.sqrt(fan_in)))
