"""Greedy tokens of the runtime equal Hugging Face ``generate`` (torch, float32) on tiny random models of several
families: exported (legacy exporter), rewritten (fp16 KV cache), run by the engine on the reference executor.

One engine run per family covers the scheduling cases at once: a ragged batch (5 .. 40 tokens), chunked prefill
mixed with decodes (8-token chunks, a 24-token budget), requests arriving mid-stream (after two and five steps)
and a shared prompt prefix (prefix reuse on: the later requests skip the cached pages). Every request is
compared with ``model.generate`` of its prompt alone (greedy, no EOS). The rewritten graph keeps K/V in fp16,
HF in float32: where the tokens part, HF's own logits must show a near-tie there (top-2 gap within the fp16
tolerance on the logits' scale) — reported as a tie, and the rest of that request is not compared (its inputs
differ from then on); every other token must be equal, and ties must stay rare.
"""

from __future__ import annotations

import pytest
from conftest import TOLERANCES
from runtime_support import compared_total, hf_scenario

from pagedkv.onnx_export import hf

NO_EXPORT = hf.why_export_unavailable()
pytestmark = pytest.mark.skipif(NO_EXPORT is not None, reason=f"export extra missing: {NO_EXPORT}")

FAMILIES = ["llama", "mistral", "qwen2", "gemma", "gpt_neox", "phi"]


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_equals_hf_generate(family, tmp_path):
    compared, ties = hf_scenario(family, tmp_path, backend="reference", tolerance=TOLERANCES["float16"])
    assert compared >= 0.8 * compared_total() and ties <= 2, (compared, ties)
