"""Other exporters' decoder-with-past graphs, made the way their users make them (for the rewrite's exporter
matrix, ``tests/test_exporters.py``; ``docs/builder.md`` has the matrix):

    model_dir = save_model_dir("llama", "hf/llama")      # a family's tiny config, random weights, a tokenizer
    export_transformers("llama", "tx/")                  # transformers.exporters OnnxExporter -> tx/model.onnx
    export_transformers("llama", "txf/", ort_fusions="cpu")          # ... with ONNX Runtime fusions
    export_genai(model_dir, "genai/", packed_qkv=False)  # onnxruntime_genai.models.builder -> genai/model.onnx
    export_optimum(model_dir, "opt/", python="/venv/bin/python")     # optimum-cli export onnx -> opt/model.onnx

Each returns the path of the decoder-with-past ``.onnx`` (its weights beside it, in the exporter's own layout).
Their I/O names are their own (``input.cache.layers.0.keys``, ``past_key_values.0.key`` ...); the rewrite and
``compare`` recognize graphs by structure, not by names. Nothing touches the network (``HF_HUB_OFFLINE=1``).

* transformers' exporter (``transformers.exporters``, transformers >= 5.24): the ``decode`` component of
  ``decompose_for_generation(..., multi_token_decode=True)`` (a dynamic query length over a cache: the
  decoder-with-past), exported with ``OnnxConfig(dynamic=True, ort_fusions=None | "cpu")``.
* ONNX Runtime GenAI's model builder (``python -m onnxruntime_genai.models.builder -i DIR -o OUT -p fp32 -e
  cpu``): ``com.microsoft::GroupQueryAttention`` with RoPE inside, QKV packed into one MatMul by default,
  separate with ``disable_qkv_fusion=true``. It reads the model directory's tokenizer, and it takes any Linear
  whose output width is the vocabulary size for the LM head, so the model made for it needs a vocabulary no
  projection shares (``GENAI_VOCAB``).
* Hugging Face Optimum (``optimum-onnx``, ``--task text-generation-with-past``): pins transformers < 4.58, so it
  runs in its own environment, given by ``python`` (the interpreter of that venv).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pagedkv.onnx_export.hf import require_export_deps

GENAI_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi", "gemma")  # the builder has no GPT-NeoX / GPT-J
GENAI_VOCAB = 160  # no family's tiny config has a projection 160 wide
TOKENIZER_VOCAB_PREFIX = "t"


def _tiny_model(family: str, seed: int, attn_implementation: str, **overrides):
    torch, transformers = require_export_deps()
    from pagedkv.onnx_export._hf_families import randomize_weights, tiny_config

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    randomize_weights(model, seed)
    return model.eval()


def save_model_dir(family: str, path, *, seed: int = 0, vocab_size: int | None = None) -> Path:
    """A local Hugging Face model directory: the family's tiny config (``vocab_size`` overriding its vocabulary),
    random weights (``randomize_weights``), and a word-level tokenizer over the vocabulary (``t0 t1 ...``: model
    builders read a tokenizer; the tests feed token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    overrides = {"vocab_size": vocab_size} if vocab_size else {}
    model = _tiny_model(family, seed, "eager", **overrides)
    path = Path(path)
    model.save_pretrained(path)
    vocab = {f"{TOKENIZER_VOCAB_PREFIX}{i}": i for i in range(model.config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2",
                            pad_token="t0").save_pretrained(path)
    return path


def export_transformers(family: str, out_dir, *, attn_implementation: str = "sdpa", ort_fusions: str | None = None,
                        seed: int = 0) -> Path:
    """transformers' own exporter on the family's tiny model: the multi-token ``decode`` component -> model.onnx."""
    torch, _ = require_export_deps()
    from transformers.exporters import OnnxConfig, OnnxExporter
    from transformers.exporters.utils import decompose_for_generation

    model = _tiny_model(family, seed, attn_implementation)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(seed))
    stages = decompose_for_generation(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                      multi_token_decode=True)
    exported = OnnxExporter().export(*stages["decode"], OnnxConfig(dynamic=True, ort_fusions=ort_fusions))
    exported.save_pretrained(out_dir)
    return Path(out_dir) / "model.onnx"


def _run(args: list[str], what: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(args, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(args)}\n{proc.stdout[-2000:]}"
                           f"\n{proc.stderr[-4000:]}")


def export_genai(model_dir, out_dir, *, packed_qkv: bool = True) -> Path:
    """ONNX Runtime GenAI's model builder, fp32 for the CPU, on a model directory (``save_model_dir`` with
    ``vocab_size=GENAI_VOCAB``) -> out_dir/model.onnx."""
    args = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(model_dir), "-o", str(out_dir),
            "-p", "fp32", "-e", "cpu"]
    if not packed_qkv:
        args += ["--extra_options", "disable_qkv_fusion=true"]
    _run(args, "onnxruntime_genai model builder")
    return Path(out_dir) / "model.onnx"


def export_optimum(model_dir, out_dir, *, python: str = sys.executable) -> Path:
    """Optimum's ONNX export (``optimum-cli export onnx --task text-generation-with-past``), run by ``python`` (the
    interpreter of an environment with optimum-onnx) -> out_dir/model.onnx."""
    _run([python, "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", str(model_dir), "--task",
          "text-generation-with-past", str(out_dir)], "optimum-cli export onnx")
    return Path(out_dir) / "model.onnx"
