"""Per-layer K/V scales for quantized caches (fp8 e4m3, int8), measured on the original graph.

    from pagedkv.builder.calibrate import calibrate_kv, load_prompts
    calibration = calibrate_kv("model.onnx", load_prompts("calib.jsonl"))   # or random_prompts(vocab)
    rewrite_model("model.onnx", RewriteOptions(cache_dtype="fp8", calibration=calibration))

Every prompt runs through the ORIGINAL decoder-with-past graph as one prefill (ONNX Runtime,
``pagedkv.runtime.session.DenseSession``); the present K of each layer (after RoPE: what the cache stores) and its
present V give the layer's amax, the largest |x| over all prompts, positions, heads and dims. The scale is

    scale = amax / QMAX        QMAX = 448 for fp8 e4m3 (its largest finite value), 127 for int8 (symmetric)

so the largest calibrated value maps onto the format's largest. No margin: a value beyond the calibrated amax
saturates (the kernels clamp: ``__NV_SATFINITE`` for e4m3, a clip to [-128, 127] for int8), it never overflows;
a margin would spend resolution on every value to protect the rare outlier.

Prompts (``load_prompts``): JSON lines ``{"input_ids": [...]}`` (or ``{"text": "..."}`` with a tokenizer), or a
text file, one prompt per non-empty line, with a local tokenizer directory (``tokenizer.json`` through HF
``tokenizers``, else ``transformers.AutoTokenizer`` with ``local_files_only``). Without a file: random token ids
(``random_prompts``), which exercise the weights but not the activation statistics of real text; calibrate on
text like the deployment's for a real model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedkv import onnx_io
from pagedkv.layout import CacheDType
from pagedkv.reference.quant import FP8_E4M3_MAX, INT8_MAX

QMAX = {CacheDType.FP8_E4M3: FP8_E4M3_MAX, CacheDType.INT8: float(INT8_MAX)}
DEFAULT_PROMPTS, DEFAULT_PROMPT_LEN = 8, 128


class CalibrationError(ValueError):
    """Calibration cannot run on these inputs; the message names the file, line or layer."""


@dataclass(frozen=True)
class KVCalibration:
    """K/V amax per layer of the original graph (layer i: ``present[i]``, its present key / value outputs)."""

    present: tuple[tuple[str, str], ...]  # (present key, present value) output names per layer
    k_amax: tuple[float, ...]
    v_amax: tuple[float, ...]
    prompts: int
    tokens: int
    source: str  # where the prompts came from

    def scales(self, cache_dtype) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(k_scales, v_scales) per layer for ``cache_dtype``: amax / QMAX (module docstring)."""
        cache_dtype = CacheDType.parse(cache_dtype)
        if cache_dtype not in QMAX:
            raise CalibrationError(f"cache_dtype: scales are for quantized caches (fp8, int8), got {cache_dtype.name}")
        qmax = QMAX[cache_dtype]
        return tuple(a / qmax for a in self.k_amax), tuple(a / qmax for a in self.v_amax)

    def describe(self, cache_dtype) -> str:
        qmax = QMAX[CacheDType.parse(cache_dtype)]
        return (f"calibrated on {self.prompts} prompt(s), {self.tokens} tokens ({self.source}): "
                f"scale = amax / {qmax:g}")


def random_prompts(vocab: int, num: int = DEFAULT_PROMPTS, length: int = DEFAULT_PROMPT_LEN,
                   seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=length, dtype=np.int64) for _ in range(num)]


def _tokenizer(directory):
    directory = Path(directory)
    if (directory / "tokenizer.json").is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise CalibrationError("tokenizer: reading tokenizer.json needs HF tokenizers (pip install "
                                   "'pagedkv[export]')") from None

        tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        return lambda text: tok.encode(text).ids
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise CalibrationError(f"tokenizer: {str(directory)!r} has no tokenizer.json, and transformers (to read "
                               "other tokenizer files) is not installed") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"tokenizer: cannot load a tokenizer from {str(directory)!r}: {exc}") from None
    return lambda text: tok(text)["input_ids"]


def load_prompts(path, tokenizer=None) -> list[np.ndarray]:
    """Prompts from ``path`` (module docstring): token ids per prompt. ``tokenizer``: a local tokenizer directory,
    needed for text."""
    path = Path(path)
    encode = _tokenizer(tokenizer) if tokenizer is not None else None
    prompts = []
    lines = path.read_text(encoding="utf-8").splitlines()
    as_json = path.suffix in (".jsonl", ".json") or (lines and lines[0].lstrip().startswith("{"))
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        if as_json:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationError(f"{where}: not a JSON object: {exc.msg}") from None
            if not isinstance(record, dict) or not ({"input_ids", "text"} & set(record)):
                raise CalibrationError(f"{where}: expected {{\"input_ids\": [...]}} or {{\"text\": \"...\"}}")
            if "input_ids" in record:
                ids = record["input_ids"]
                if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
                    raise CalibrationError(f"{where}: input_ids must be a non-empty list of integers >= 0")
                prompts.append(np.asarray(ids, dtype=np.int64))
                continue
            text = record["text"]
        else:
            text = line
        if encode is None:
            raise CalibrationError(f"{where}: text prompts need a tokenizer (--tokenizer DIR: a local tokenizer "
                                   "directory)")
        ids = list(encode(text))
        if ids:
            prompts.append(np.asarray(ids, dtype=np.int64))
    if not prompts:
        raise CalibrationError(f"{path}: no prompts found")
    return prompts


def calibrate_kv(model, prompts, *, source: str = "", quiet: bool = False) -> KVCalibration:
    """Run each prompt through the original graph (path or ModelProto, any size: ``pagedkv.onnx_io``) and record
    per-layer K/V amax."""
    from pagedkv.builder.compare import vocab_size
    from pagedkv.builder.precision import emulate_in_float32
    from pagedkv.runtime.graph import DecoderGraph
    from pagedkv.runtime.session import DenseSession
    from pagedkv.userio import progress

    model = onnx_io.load_if_path(model, "original graph")  # any size: weights stay on disk for ONNX Runtime
    graph = DecoderGraph.load(model)
    vocab = vocab_size(model, graph.logits)
    for i, p in enumerate(prompts):
        if p.size == 0 or int(p.max()) >= vocab:
            raise CalibrationError(f"prompt {i}: token ids must be non-empty and < the vocabulary size {vocab}")
    dense = DenseSession(emulate_in_float32(model))  # ONNX Runtime's CPU has no bfloat16 kernels
    k_amax = np.zeros(graph.num_layers)
    v_amax = np.zeros(graph.num_layers)
    for i, prompt in enumerate(progress(prompts, desc="calibrating K/V", unit="prompt", quiet=quiet)):
        dense.step([(i, prompt)])
        for layer in range(graph.num_layers):
            k, v = dense.present(i, layer)
            k_amax[layer] = max(k_amax[layer], float(np.max(np.abs(k))))
            v_amax[layer] = max(v_amax[layer], float(np.max(np.abs(v))))
        dense.free(i)
    for name, amax in (("K", k_amax), ("V", v_amax)):
        for layer, a in enumerate(amax):
            if not (math.isfinite(a) and a > 0):
                raise CalibrationError(f"layer {layer}: {name} amax is {a} over the calibration prompts; a scale needs "
                                       "a finite, non-zero amax")
    return KVCalibration(graph.present, tuple(float(a) for a in k_amax), tuple(float(a) for a in v_amax),
                         len(prompts), int(sum(p.size for p in prompts)), source or "given prompts")



@dataclass(frozen=True)
class CalibrationPlan:
    """How to calibrate, for ``RewriteOptions.calibration``: the rewrite runs it on its input graph. Prompts come
    from ``data`` (a file, ``load_prompts``; ``tokenizer`` for text) or are ``num_prompts`` random token-id
    prompts of ``prompt_len`` tokens from ``seed``."""

    data: str | None = None
    tokenizer: str | None = None
    num_prompts: int = DEFAULT_PROMPTS
    prompt_len: int = DEFAULT_PROMPT_LEN
    seed: int = 0

    def __post_init__(self):
        for name in ("num_prompts", "prompt_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"calibration {name}: expected >= 1, got {getattr(self, name)}")

    def run(self, model, *, quiet: bool = False) -> KVCalibration:
        model = onnx_io.load_if_path(model, "original graph")
        if self.data is not None:
            prompts = load_prompts(self.data, self.tokenizer)
            source = str(self.data) + (f", tokenizer {self.tokenizer}" if self.tokenizer else "")
        else:
            from pagedkv.builder.compare import vocab_size
            from pagedkv.runtime.graph import DecoderGraph

            vocab = vocab_size(model, DecoderGraph.load(model).logits)
            prompts = random_prompts(vocab, self.num_prompts, self.prompt_len, self.seed)
            source = f"random token ids, seed {self.seed}"
        return calibrate_kv(model, prompts, source=source, quiet=quiet)
