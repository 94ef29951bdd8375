"""Other exporters' graphs through rewrite -> compare (``pagedkv.onnx_export.third_party``; the PyTorch exporters'
matrix is tests/test_export_hf.py, the whole matrix is in docs/builder.md):

* transformers' own exporter (``transformers.exporters.OnnxExporter``), with and without ONNX Runtime fusions
  (``ort_fusions="cpu"``), sdpa and eager, every family;
* ONNX Runtime GenAI's model builder (``com.microsoft::GroupQueryAttention``, RoPE inside, packed or separate QKV),
  every family it builds;
* Hugging Face Optimum (``optimum-cli export onnx --task text-generation-with-past``), every family, in its own
  environment (it pins transformers < 4.58): ``PAGEDKV_OPTIMUM_PYTHON`` names its interpreter (``.ci/run`` makes
  it); without it those cells skip, saying so.

Each cell is ``conftest.rewrite_and_compare`` (ragged batch, chunked prefill, 8 decode steps, fp16-cache
tolerance, greedy tokens, paged K/V). Cells an exporter cannot give us go into GAPS: strict xfails that must raise
RewriteError, naming the node and what was expected.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from conftest import rewrite_and_compare

from pagedkv.onnx_export import hf
from pagedkv.onnx_export._hf_families import FAMILIES

# The families these exporters' cells run: the first eight. gpt2, phi3, qwen2_yarn and gemma2 (YaRN / LongRoPE,
# learned positions, the soft-cap) arrived with the last merge of main and have not been run through these
# exporters yet: they are in tests/test_export_hf.py's PyTorch matrix only.
EXPORTER_FAMILIES = tuple(f for f in FAMILIES if f not in ("gpt2", "phi3", "qwen2_yarn", "gemma2"))

NO_EXPORT = hf.why_export_unavailable()
needs_export = pytest.mark.skipif(NO_EXPORT is not None, reason=f"export extra missing: {NO_EXPORT}")


def _why_no_transformers_exporter() -> str | None:
    if NO_EXPORT:
        return NO_EXPORT
    return None if importlib.util.find_spec("transformers.exporters") else \
        "transformers has no transformers.exporters (it arrived in 5.24)"


def _why_no_genai() -> str | None:
    return None if importlib.util.find_spec("onnxruntime_genai") else "onnxruntime-genai is not installed"


OPTIMUM_PYTHON = os.environ.get("PAGEDKV_OPTIMUM_PYTHON")


def _why_no_optimum() -> str | None:
    if not OPTIMUM_PYTHON:
        return "PAGEDKV_OPTIMUM_PYTHON is not set (the interpreter of an environment with optimum-onnx; .ci/run makes one)"
    return None if Path(OPTIMUM_PYTHON).is_file() else f"PAGEDKV_OPTIMUM_PYTHON={OPTIMUM_PYTHON!r} does not exist"


# (exporter, family, variant) -> the RewriteError the rewrite gives today (strict xfail).
GAPS = {
    ("genai", "qwen3", "packed"): "the builder keeps q/k/v apart and reshapes q to [batch, seq * heads, head_dim] "
                                  "for its q/k RMSNorm: the sequence and head axes merged, which the layout tracer "
                                  "does not follow",
    ("genai", "qwen3", "separate"): "as packed: q/k RMSNorm over [batch, seq * heads, head_dim]",
}


def _rewrite_error():
    from pagedkv.builder.rewrite import RewriteError

    return RewriteError


def _marks(key, reason):
    marks = [pytest.mark.skipif(reason is not None, reason=str(reason))]
    if key in GAPS:
        marks.append(pytest.mark.xfail(strict=True, raises=_rewrite_error(), reason=f"rewrite gap: {GAPS[key]}"))
    return marks


def _transformers_cells():
    reason = _why_no_transformers_exporter()
    for fusions in ("none", "cpu"):
        for attention in hf.ATTENTION_IMPLEMENTATIONS:
            for family in EXPORTER_FAMILIES:
                variant = f"{attention}-{fusions}"
                yield pytest.param(family, attention, fusions, marks=_marks(("transformers", family, variant), reason),
                                   id=f"{family}-{variant}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family,attention,fusions", list(_transformers_cells()))
def test_transformers_exporter(family, attention, fusions, tmp_path):
    from pagedkv.onnx_export.third_party import export_transformers

    path = export_transformers(family, tmp_path / "export", attn_implementation=attention,
                               ort_fusions=None if fusions == "none" else fusions)
    rewritten = rewrite_and_compare(path, f"{family}/transformers.exporters {attention} fusions={fusions}")
    assert {r.window for r in rewritten.report.layers} == {8 if family == "mistral" else 0}
    if family == "mistral":  # its sliding-window cache layers carry a scalar state through: dropped with it
        assert any("_sliding_window_tensor" in name for name in rewritten.report.removed_inputs)


def _genai_cells():
    from pagedkv.onnx_export.third_party import GENAI_FAMILIES

    reason = _why_no_genai() or NO_EXPORT
    for variant in ("packed", "separate"):
        for family in GENAI_FAMILIES:
            yield pytest.param(family, variant, marks=_marks(("genai", family, variant), reason),
                               id=f"{family}-{variant}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family,variant", list(_genai_cells()))
def test_genai_model_builder(family, variant, tmp_path):
    import onnx

    from pagedkv.onnx_export.third_party import GENAI_VOCAB, export_genai, save_model_dir

    model_dir = save_model_dir(family, tmp_path / "hf", vocab_size=GENAI_VOCAB)
    path = export_genai(model_dir, tmp_path / "genai", packed_qkv=variant == "packed")
    gqa = [n for n in onnx.load(str(path), load_external_data=False).graph.node if n.op_type == "GroupQueryAttention"]
    packed = variant == "packed" and family != "qwen3"  # the builder keeps q, k, v apart around q/k norms
    assert gqa and all(bool(n.input[1]) != packed for n in gqa)  # packed: empty key/value inputs
    rewritten = rewrite_and_compare(path, f"{family}/onnxruntime-genai {variant}")
    assert [r.pattern for r in rewritten.report.layers] == ["contrib_gqa"] * len(gqa)


def _optimum_cells():
    reason = _why_no_optimum()
    for family in EXPORTER_FAMILIES:
        yield pytest.param(family, marks=_marks(("optimum", family, "sdpa"), reason), id=family)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", list(_optimum_cells()))
def test_optimum_export(family, tmp_path):
    from pagedkv.onnx_export.third_party import export_optimum, save_model_dir

    model_dir = save_model_dir(family, tmp_path / "hf")
    path = export_optimum(model_dir, tmp_path / "optimum", python=OPTIMUM_PYTHON)
    rewrite_and_compare(path, f"{family}/optimum")


@needs_export
def test_save_model_dir_writes_a_loadable_model_and_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedkv.onnx_export.third_party import save_model_dir

    path = save_model_dir("qwen2", tmp_path / "m", vocab_size=160)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert model.config.vocab_size == 160 and len(tokenizer) == 160
    assert tokenizer.convert_tokens_to_ids(["t5", "t7", "t159"]) == [5, 7, 159]
