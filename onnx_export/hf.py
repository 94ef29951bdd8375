"""Export Hugging Face decoder models to ONNX in the decoder-with-past convention, fully offline.

    from pagedkv.onnx_export.hf import export_hf
    result = export_hf("llama", "llama.onnx", exporter="legacy")      # tiny config, random weights
    result = export_hf("/models/my-llama", "my.onnx", exporter="dynamo")  # a local model directory

Graph I/O (both exporters; names are fixed by the exporter call, so dynamo's ``input.cache.layers.*``
names do not appear)::

    inputs : input_ids INT64 [batch, seq], attention_mask INT64 [batch, past+seq],
             position_ids INT64 [batch, seq], past_key_values.{i}.key|value [batch, kv_heads, past, head_dim]
    outputs: logits [batch, seq, vocab], present.{i}.key|value [batch, kv_heads, past+seq, head_dim]

Files: ``path`` and ``path`` + ``.data`` (every weight of 1 KiB or more, in one file; ``pagedkv.onnx_io``), written
together once the export is verified, whatever the model's size.

Exporters: ``legacy`` = ``torch.onnx.export(..., dynamo=False)`` (TorchScript tracing, opset 17, fully
decomposed) and ``dynamo`` = ``torch.onnx.export(..., dynamo=True)`` (torch.export, opset 20 by default).
Tracing bakes Python control flow in, so every export is verified against the eager model on shapes other
than the traced one (prefill with no past, decode past the sliding window, a left-padded batch). The exporter
writes into a private folder beside ``path``, the graph is verified there, and only then ``onnx_io.save`` writes
``path`` and its data file together (atomically): a failed export or verification leaves nothing behind.
Attention: ``sdpa`` by default, as transformers loads models (``attn_implementation="eager"`` for the explicit
form).

``dtype`` float16 / bfloat16 exports the model in that dtype; its rotary ``inv_freq`` buffers stay float32
(transformers' rotary modules read them with ``.float()``; ``model.to(float16)`` would round them by up to 2^-12,
turning angles by 0.4 rad at position 4096, where the plugin computes them from theta in float32). A 16-bit
export is verified against the eager model run in float32 with the same (rounded) weights, relative to each
output's scale, with the dtype's tolerance (``pagedkv.tolerances.MODEL_TOLERANCES``), or no farther from it
than twice eager PyTorch in the export's dtype is; the graph runs emulated in float32
(``pagedkv.builder.precision.emulate_in_float32``: ONNX Runtime's CPU provider has no bfloat16 kernels), and its
types are checked as a strongly typed TensorRT network needs them (``precision.check_types``).

torch, transformers and onnxscript are the optional ``export`` extra (``pip install pagedkv[export]``);
they are imported only when an export runs. Nothing here touches the network: ``HF_HUB_OFFLINE=1`` is set
before transformers is imported and model directories are opened with ``local_files_only=True``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pagedkv import onnx_io
from pagedkv.onnx_export._hf_families import FAMILIES, randomize_weights, tiny_config
from pagedkv.userio import check_output_path

EXPORTERS = ("legacy", "dynamo")
DEFAULT_OPSET = {"legacy": 17, "dynamo": 20}
MIN_OPSET = 14
DTYPES = ("float32", "float16", "bfloat16")
# transformers loads models with SDPA attention unless told otherwise: so does the export.
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
DEFAULT_ATTENTION = "sdpa"
ROTARY_FREQUENCY_BUFFERS = ("inv_freq", "original_inv_freq")  # kept float32 in 16-bit exports (docstring)


class ExportError(RuntimeError):
    """The export failed or the exported graph does not reproduce the eager model."""


class MissingExportDependencies(ImportError):
    pass


def require_export_deps():
    """Import torch and transformers (the ``export`` extra) or raise with the install command."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    missing = []
    try:
        import torch
    except ImportError:
        torch = None
        missing.append("torch")
    try:
        import transformers
    except ImportError:
        transformers = None
        missing.append("transformers")
    if missing:
        raise MissingExportDependencies(
            f"pagedkv export needs {' and '.join(missing)} (not installed): pip install 'pagedkv[export]'")
    return torch, transformers


def why_export_unavailable() -> str | None:
    """None when torch + transformers import, else the reason (for test skips)."""
    try:
        require_export_deps()
    except MissingExportDependencies as exc:
        return str(exc)
    return None


@dataclass
class ExportResult:
    path: Path
    source: str
    exporter: str
    opset: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    seconds: float
    verify_max_abs_err: float | None
    input_names: list[str] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    dtype: str = "float32"
    verification: str = ""  # how it was verified (16-bit exports: against what, in which precision)

    def __str__(self) -> str:
        check = ("not verified" if self.verify_max_abs_err is None
                 else self.verification or f"verified vs eager, max abs err {self.verify_max_abs_err:.2e}")
        return (f"{self.path} (+ {onnx_io.data_path(self.path).name}): {self.source} via {self.exporter} exporter "
                f"(opset {self.opset}), {self.dtype}, "
                f"{self.num_layers} layers, {self.num_kv_heads} KV heads x {self.head_dim}, "
                f"{self.seconds:.1f} s, {check}")


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    inputs = ["input_ids", "attention_mask", "position_ids"]
    outputs = ["logits"]
    for i in range(num_layers):
        inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs


def load_model(source: str | os.PathLike, *, seed: int = 0, attn_implementation: str = DEFAULT_ATTENTION,
               dtype: str = "float32"):
    """A family name (tiny config, random weights from ``seed``) or a local model directory, in eval mode."""
    torch, transformers = require_export_deps()
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    source = str(source)
    if source in FAMILIES:
        config = tiny_config(source)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        randomize_weights(model, seed)
    elif Path(source).is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source, local_files_only=True, attn_implementation=attn_implementation)
    else:
        raise ValueError(f"source: {source!r} is neither a family ({', '.join(sorted(FAMILIES))}) "
                         "nor a local model directory")
    frequencies = {name: buf.detach().float().clone() for name, buf in model.named_buffers()
                   if name.rsplit(".", 1)[-1] in ROTARY_FREQUENCY_BUFFERS}
    model = model.to(torch_dtype).eval()
    for name, value in frequencies.items():  # float32 rotary frequencies (module docstring)
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value
    return model


def _geometry(model) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) read off a real forward pass (robust to per-family config names)."""
    import torch
    from transformers import DynamicCache

    from pagedkv.onnx_export._hf_wrapper import _cache_kwarg, _layers_of

    with torch.no_grad():
        out = model(input_ids=torch.zeros((1, 2), dtype=torch.long), use_cache=True,
                    **{_cache_kwarg(model): DynamicCache()})
    returned = getattr(out, "cache", None)
    layers = _layers_of(returned if returned is not None else out.past_key_values)
    _, kv_heads, _, head_dim = layers[0][0].shape
    return len(layers), int(kv_heads), int(head_dim)


def _inputs(batch, seq, past, num_layers, kv_heads, head_dim, vocab, dtype, seed, left_pad=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    mask = torch.ones((batch, past + seq), dtype=torch.long)
    positions = torch.arange(past, past + seq).expand(batch, seq).clone()
    if left_pad:  # the first sequence is left-padded by `left_pad` positions (prefill only)
        mask[0, :left_pad] = 0
        positions[0] = torch.clamp(torch.arange(seq) - left_pad, min=0)
    pasts = [torch.randn((batch, kv_heads, past, head_dim), generator=gen).to(dtype)
             for _ in range(2 * num_layers)]
    return (ids, mask, positions, *pasts)


def _vocab(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def export_model(model, path: str | os.PathLike, *, exporter: str = "legacy", opset: int | None = None,
                 verify: bool = True, source: str = "model", step=None) -> ExportResult:
    """Export an eval-mode transformers causal LM; see the module docstring for the graph I/O. Raises
    ExportError (and leaves no file behind) when the export or its verification fails.

    The exporter writes into a private folder beside ``path`` (its own file layout: the legacy exporter scatters
    one file per weight past 2 GB), the result is verified there, and only then ``onnx_io.save`` writes ``path``
    and ``path`` + ``.data`` (every weight, one file) together. ``step``: called with the name of each step as it
    starts (``userio.phases``)."""
    step = step or (lambda name: None)
    require_export_deps()
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter: expected one of {EXPORTERS}, got {exporter!r}")
    opset = int(opset or DEFAULT_OPSET[exporter])
    path = Path(path)
    check_output_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.", suffix=".export", dir=path.parent) as raw_dir:
        raw = Path(raw_dir) / path.name
        try:
            result = _export_to(model, path, raw, exporter, opset, verify, source, step)
        except ExportError as exc:
            torch = require_export_deps()[0]
            if next(model.parameters()).dtype != torch.float32 and \
                    getattr(model.config, "_attn_implementation", None) == "sdpa":
                raise ExportError(f"{exc} (PyTorch's legacy exporter fails on some 16-bit SDPA models, or exports "
                                  "them with mixed dtypes; --attn-implementation eager exports the same attention)"
                                  ) from exc
            raise
        step(f"write {path.name} and {onnx_io.data_path(path).name}")
        onnx_io.save(onnx_io.load(raw, "exported model"), path)
    return result


def _export_to(model, path: Path, tmp: Path, exporter: str, opset: int, verify: bool, source: str,
               step) -> ExportResult:
    """Export into ``tmp`` (in a private folder: the exporter's own file layout) and verify it there."""
    torch, _ = require_export_deps()
    from pagedkv.onnx_export._hf_wrapper import DecoderWithPast, traceable_rope

    num_layers, kv_heads, head_dim = _geometry(model)
    wrapper = DecoderWithPast(model, num_layers).eval()
    dtype = next(model.parameters()).dtype
    # Distinct, non-1 sizes so that no dimension is specialised or unified with another while tracing.
    example = _inputs(2, 3, 5, num_layers, kv_heads, head_dim, _vocab(model), dtype, seed=1)
    in_names, out_names = io_names(num_layers)

    step(f"{exporter} export ({num_layers} layers)")
    start = time.perf_counter()
    try:
        with torch.no_grad(), traceable_rope(model):
            if exporter == "legacy":
                dyn = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
                       "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
                for name in in_names[3:]:
                    dyn[name] = {0: "batch", 2: "past"}
                for name in out_names[1:]:
                    dyn[name] = {0: "batch", 2: "total"}
                torch.onnx.export(wrapper, example, str(tmp), input_names=in_names, output_names=out_names,
                                  dynamic_axes=dyn, opset_version=opset, dynamo=False)
            else:
                from torch.export import Dim

                batch, seq, past, total = Dim("batch"), Dim("seq"), Dim("past"), Dim("total")
                shapes = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq},
                          tuple({0: batch, 2: past} for _ in range(2 * num_layers)))
                program = torch.onnx.export(wrapper, example, input_names=in_names, output_names=out_names,
                                            dynamic_shapes=shapes, opset_version=opset, dynamo=True)
                program.save(str(tmp))
                del program
    except Exception as exc:
        raise ExportError(f"{exporter} export of {source} failed: {type(exc).__name__}: {exc}") from exc
    seconds = time.perf_counter() - start

    dtype_name = str(dtype).removeprefix("torch.")
    err, how = None, ""
    if verify:
        step(f"verify against eager PyTorch on {len(VERIFY_CASES)} shapes")
        shapes = (num_layers, kv_heads, head_dim, _vocab(model))
        if dtype == torch.float32:
            err = _verify(wrapper, tmp, path, *shapes, dtype)
        else:
            err, how = _verify_reduced(model, wrapper, tmp, path, *shapes, dtype)
    return ExportResult(path, source, exporter, opset, num_layers, kv_heads, head_dim, seconds, err,
                        in_names, out_names, dtype_name, how)


# Shapes other than the traced one: (batch, seq, past, left_pad)
VERIFY_CASES = {
    "prefill, no past": (1, 7, 0, 0),
    "decode past a short window": (3, 1, 11, 0),
    "left-padded prefill": (2, 6, 0, 2),
    "chunk over a cached prefix": (2, 4, 9, 0),
}


def _verify_runs(session, models, path, num_layers, kv_heads, head_dim, vocab, dtype):
    """Per case and output: (what, case, name, graph output, [each eager model's output]) as float64, the
    positions of left padding dropped (meaningless in both: their query rows see nothing in the logits, and what
    they computed reaches the next layer's K/V in the presents). ``models``: eager wrappers, fed the same inputs
    (cast to each one's dtype)."""
    import torch

    in_names = [i.name for i in session.get_inputs()]
    feed_types = {i.name: np.float32 if i.type == "tensor(float)" else None for i in session.get_inputs()}
    for seed, (what, case) in enumerate(VERIFY_CASES.items()):
        batch, seq, past, left_pad = case
        args = _inputs(batch, seq, past, num_layers, kv_heads, head_dim, vocab, dtype, seed + 10, left_pad)
        expected = []
        with torch.no_grad():
            for wrapper, wrapper_dtype in models:
                cast = [a.to(wrapper_dtype) if a.is_floating_point() else a for a in args]
                expected.append([t.float().numpy().astype(np.float64) for t in wrapper(*cast)])
        feed = {n: (a.float() if feed_types[n] is not None else a).numpy() for n, a in zip(in_names, args)}
        got = session.run(None, feed)
        for k, name in enumerate(o.name for o in session.get_outputs()):
            g, es = got[k].astype(np.float64), [e[k] for e in expected]
            if any(e.shape != g.shape for e in es):
                raise ExportError(f"{path}: output {name} has shape {g.shape} in ONNX Runtime but {es[0].shape} "
                                  f"in PyTorch ({what})")
            if left_pad:
                live = np.ones((batch, seq), dtype=bool)
                live[0, :left_pad] = False
                if name == "logits":
                    g, es = g[live], [e[live] for e in es]
                else:  # [batch, kv_heads, past + seq, head_dim] with past 0: positions are the query rows
                    g, es = g.transpose(0, 2, 1, 3)[live], [e.transpose(0, 2, 1, 3)[live] for e in es]
            yield what, case, name, g, es


def _verify(wrapper, tmp, path, num_layers, kv_heads, head_dim, vocab, dtype) -> float:
    """float32: the exported graph vs the eager model on shapes other than the traced one, element-wise
    (``pagedkv.tolerances.EXPORT_FLOAT32_TOLERANCE``); returns the max abs err."""
    from pagedkv.tolerances import EXPORT_FLOAT32_TOLERANCE

    atol, rtol = EXPORT_FLOAT32_TOLERANCE
    session = onnx_io.ort_session(tmp)
    worst = 0.0
    for what, (batch, seq, past, _), name, g, (e,) in _verify_runs(session, [(wrapper, dtype)], path,
                                                                      num_layers, kv_heads, head_dim, vocab, dtype):
        diff = np.abs(g - e)
        if not np.all(diff <= atol + rtol * np.abs(e)):
            raise ExportError(f"{path}: output {name} differs from eager PyTorch ({what}: batch {batch}, "
                              f"seq {seq}, past {past}): max abs err {diff.max():.3e} — the exporter baked "
                              "in a shape-dependent branch")
        worst = max(worst, float(diff.max()) if diff.size else 0.0)
    return worst


def _verify_reduced(model, wrapper, tmp, path, num_layers, kv_heads, head_dim, vocab, dtype) -> tuple[float, str]:
    """16-bit: the graph (emulated in float32) against the eager model in float32 with the same weights, relative
    to each output's scale (module docstring). Returns (max abs err, how it was verified)."""
    import copy

    import torch

    from pagedkv.builder.precision import DTypeError, check_types, emulate_in_float32
    from pagedkv.onnx_export._hf_wrapper import DecoderWithPast
    from pagedkv.tolerances import MODEL_TOLERANCES

    name = str(dtype).removeprefix("torch.")
    atol, rtol = MODEL_TOLERANCES[name]
    graph = onnx_io.load(tmp, "exported model")
    try:
        check_types(graph)
    except DTypeError as exc:
        raise ExportError(f"{path}: the exported {name} graph mixes dtypes: {exc}") from None
    session = onnx_io.ort_session(emulate_in_float32(graph))
    reference = DecoderWithPast(copy.deepcopy(model).float(), num_layers).eval()
    worst_abs, worst, worst_eager = 0.0, 0.0, 0.0
    for what, (batch, seq, past, _), out, g, (e32, e16) in _verify_runs(
            session, [(reference, torch.float32), (wrapper, dtype)], path, num_layers, kv_heads, head_dim, vocab,
            dtype):
        scale = float(np.max(np.abs(e32))) if e32.size else 0.0
        if not scale:
            continue
        err, eager = float(np.max(np.abs(g - e32))), float(np.max(np.abs(e16 - e32)))
        bound = atol + rtol * scale
        if err > max(bound, 2 * eager):
            raise ExportError(
                f"{path}: output {out} ({what}: batch {batch}, seq {seq}, past {past}) is off the float32 model by "
                f"{err / scale:.2e} of its scale, eager PyTorch in {name} only by {eager / scale:.2e} (bound "
                f"{bound / scale:.2e}): the graph computes something else than the model (a branch baked in by "
                "tracing, or a dtype the exporter changed), not just rounding")
        worst_abs = max(worst_abs, err)
        worst, worst_eager = max(worst, err / scale), max(worst_eager, eager / scale)
    how = (f"verified vs eager float32 with the same weights: max err {worst:.2e} of the scale (eager {name}: "
           f"{worst_eager:.2e}; bound {atol:g} + {rtol:g} * scale), the graph run in float32 with {name} rounding "
           f"per op (ONNX Runtime's CPU provider has no bfloat16 kernels: both 16-bit dtypes run so), its types "
           "checked")
    return worst_abs, how


EXPORT_STEPS = 4  # export_hf's steps: load, export, verify, write (verify=False: no verify)


def export_hf(source: str | os.PathLike, path: str | os.PathLike, *, exporter: str = "legacy", seed: int = 0,
              opset: int | None = None, attn_implementation: str = DEFAULT_ATTENTION, dtype: str = "float32",
              verify: bool = True, step=None) -> ExportResult:
    """Load ``source`` (family name or model directory) and export it; see the module docstring. ``step``: called
    with the name of each step as it starts (``userio.phases``)."""
    step = step or (lambda name: None)
    step(f"load {Path(str(source)).name}")
    model = load_model(source, seed=seed, attn_implementation=attn_implementation, dtype=dtype)
    return export_model(model, path, exporter=exporter, opset=opset, verify=verify, source=str(source), step=step)


# ---- CLI ----------------------------------------------------------------------------------------------
def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--family", choices=sorted(FAMILIES), help="tiny config of a family, random weights")
    src.add_argument("--model-dir", help="a local Hugging Face model directory (no hub access)")
    parser.add_argument("-o", "--output", required=True, help="output .onnx path")
    parser.add_argument("--exporter", choices=EXPORTERS, default="legacy",
                        help="legacy: TorchScript tracing; dynamo: torch.export")
    parser.add_argument("--opset", type=int, default=None, help=f"ONNX opset, >= {MIN_OPSET} (default: 17 legacy, "
                                                                 "20 dynamo)")
    parser.add_argument("--seed", type=int, default=0, help="random weights of --family")
    parser.add_argument("--attn-implementation", default=DEFAULT_ATTENTION, choices=ATTENTION_IMPLEMENTATIONS,
                        help="transformers' attention code path (its default, as transformers loads models)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="export in this dtype (16-bit: verified against the float32 model; docs/builder.md)")
    parser.add_argument("--no-verify", action="store_true", help="skip the ONNX Runtime vs eager check")


def run_export(args) -> int:
    import json

    import onnx

    from pagedkv.userio import UsageError, check_input_dir, check_int, check_output_path, phases

    if args.model_dir is not None:
        model_dir = check_input_dir(args.model_dir, "--model-dir")
        config = model_dir / "config.json"
        if not config.is_file():
            raise UsageError(f"--model-dir: {str(model_dir)!r} has no config.json; expected a Hugging Face model "
                             "directory (config.json and the weights)")
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (ValueError, AttributeError):
            model_type = None
        if not isinstance(model_type, str):
            raise UsageError(f"--model-dir: {str(config)!r} is not a Hugging Face config (a JSON object with a "
                             "model_type)")
    if args.opset is not None:  # torch.onnx exports attention (scaled_dot_product_attention) from opset 14 on
        check_int("--opset", args.opset, low=MIN_OPSET, high=onnx.defs.onnx_opset_version())
    check_output_path(args.output)
    try:
        with phases(EXPORT_STEPS - int(args.no_verify), desc="pagedkv export", quiet=getattr(args, "quiet", False)) as step:
            result = export_hf(args.family or args.model_dir, args.output, exporter=args.exporter, seed=args.seed,
                               opset=args.opset, attn_implementation=args.attn_implementation, dtype=args.dtype,
                               verify=not args.no_verify, step=step)
    except MissingExportDependencies as exc:
        raise UsageError(str(exc)) from None
    except ExportError as exc:
        print(f"pagedkv export: {exc}", file=sys.stderr)
        return 1
    print(result)
    return 0
