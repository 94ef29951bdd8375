"""Helpers shared by the runtime tests: tiny rewritten models, a tiny tokenizer directory, runs "alone".

``synthetic_rewritten(cfg, **options)`` rewrites a synthetic decoder once per (config, options) and returns the
serialized model (bytes: every test opens its own executor on it). ``tokenizer_dir(path, vocab)`` writes a BPE
tokenizer trained here on a few sentences, small enough for the tiny models' vocabularies, with a chat
template, a generation_config (EOS) and a config (context length): what a Hugging Face model directory holds.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
from pagedkv.onnx_export.synthetic import SyntheticConfig, make_synthetic_model

TINY = SyntheticConfig(num_layers=1, hidden=64, num_heads=2, num_kv_heads=1, head_dim=64, vocab=64, intermediate=64)
SMALL = SyntheticConfig(num_layers=2, hidden=64, vocab=128, intermediate=128)
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there",
          "paged attention with a kv cache is fast", "stop here. then go on"]
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
EOS = 2  # "</s>"


@functools.lru_cache(maxsize=None)
def synthetic_rewritten(cfg: SyntheticConfig = SMALL, **options) -> bytes:
    return rewrite_model(make_synthetic_model(cfg), RewriteOptions(**options)).model.SerializeToString()


def tokenizer_dir(path: Path, vocab: int = 128, max_positions: int = 512) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                                             limit_alphabet=40, show_progress=False))
    assert tok.get_vocab_size() <= vocab and tok.token_to_id("</s>") == EOS
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": max_positions}))
    return path


def random_prompts(rng: np.random.Generator, lengths, vocab: int) -> list[np.ndarray]:
    return [rng.integers(0, vocab, int(n)) for n in lengths]
