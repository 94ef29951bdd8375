"""``pagedkv demo``, the main job: end to end on the reference backend (the synthetic decoder, and a tiny Hugging
Face model when torch is installed), with every output it promises; and its accuracy check can fail: a rewritten
graph with a wrong RoPE base makes it report failure, in the logits and in the tokens.
"""

from __future__ import annotations

import json

import onnx
import pytest

from pagedkv.cli import main
from pagedkv.onnx_export import hf
from pagedkv.runtime import demo

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("source", ["synthetic", "hf"])
def test_demo_runs_end_to_end_on_the_references(tmp_path, capsys, source):
    if source == "hf" and hf.why_export_unavailable():
        pytest.skip(f"hf: {hf.why_export_unavailable()}")
    out = tmp_path / "demo"
    assert main(["demo", "-o", str(out), "--backend", "reference", "--source", source]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1].startswith("PASSED in ")
    assert "backend   reference: ONNX Runtime, plugin ops = the float64 references" in printed
    for name in ("model.onnx", "model.paged.onnx", "pagemap.png", "summary.txt", "summary.json"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "pagemap.png").read_bytes()[:8] == PNG_MAGIC
    assert (out / "summary.txt").read_text() == printed
    report = json.loads((out / "summary.json").read_text())
    assert report["passed"] and report["tokens_passed"] and report["logits"]["kv_passed"]
    assert report["backend"] == "reference"
    assert report["prefix_tokens_reused"] >= 32  # the shared prefix's two full pages
    assert report["mixed_steps"] >= 1 and report["prefill_steps"] >= 3 and report["preemptions"] == 0
    assert "share 2 blocks" in report["pagemap_note"]
    requests = report["requests"]
    assert [r["id"] for r in requests] == [r[0] for r in demo.REQUESTS]
    assert all(len(r["output_ids"]) == demo.NEW_TOKENS and r["passed"] for r in requests)
    assert sum(r["equal"] for r in requests) >= 4 * demo.NEW_TOKENS  # near-ties end a comparison; few expected
    assert not list(out.glob(".*partial"))


def _corrupt_rope(path):
    """The rewritten graph with a wrong RoPE base in every write plugin (a classic porting bug)."""
    model = onnx.load(str(path))
    changed = 0
    for node in model.graph.node:
        if node.op_type == "PagedKVQKVWrite":
            for attr in node.attribute:
                if attr.name == "rope_theta":
                    attr.f = 37.0
                    changed += 1
    assert changed
    onnx.save(model, str(path))


def test_demo_accuracy_check_fails_on_a_corrupted_rewrite(tmp_path):
    backend, why = demo.choose_backend("reference")
    model = demo.make_model(tmp_path, backend=backend, source="synthetic")
    _corrupt_rope(model.rewritten)
    report = demo.run_job(model, backend, why, tmp_path)
    assert not report.passed
    assert not report.logits["logits_passed"] and not report.logits["kv_passed"]
    assert not report.tokens_passed and any("DIFFERS" in line for line in str(report).splitlines())
    assert str(report).splitlines()[-1].startswith("FAILED")


def test_demo_bad_arguments(tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("x")
    assert main(["demo", "-o", str(target)]) == 2
    assert "--output-dir: " in capsys.readouterr().err
    from pagedkv import cuda

    if cuda.why_no_gpu():
        assert main(["demo", "-o", str(tmp_path / "d"), "--backend", "cuda"]) == 2
        assert "--backend cuda: " in capsys.readouterr().err
