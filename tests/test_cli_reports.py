"""What the verbs hand back: machine-readable reports (rewrite --json, compare --json), compare --plot, output
folders created when missing, and nothing left behind by a verb that fails (issue 14)."""

from __future__ import annotations

import json

import matplotlib.image
import onnx
import pytest
from onnx import helper

from pagedkv.cli import main
from pagedkv.onnx_export.synthetic import SyntheticConfig, export_synthetic

BASE = SyntheticConfig(num_layers=2, hidden=64, vocab=128, intermediate=128)
PROMPT_LENS = [5, 17]


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    orig = export_synthetic(BASE, root / "orig.onnx")
    rew = root / "rew.onnx"
    assert main(["rewrite", str(orig), "-o", str(rew), "--quiet"]) == 0
    return orig, rew


def test_rewrite_json_names_layers_parameters_and_pools(graphs, tmp_path, capsys):
    orig, _ = graphs
    out = tmp_path / "new" / "folder" / "r.onnx"  # missing folders are created
    assert main(["rewrite", str(orig), "-o", str(out), "--json", "--page-size", "32"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["output"] == str(out) and out.is_file()
    layers = report["report"]["layers"]
    assert [layer["index"] for layer in layers] == [0, 1]
    for layer in layers:
        assert (layer["num_heads"], layer["num_kv_heads"], layer["head_dim"]) == (BASE.num_heads,
                                                                                 BASE.num_kv_heads, BASE.head_dim)
        assert layer["rope"]["style"] == "neox" and layer["rope"]["theta"] == BASE.rope.theta
        assert layer["softmax_scale"] == pytest.approx(BASE.head_dim ** -0.5)
    (pool,) = report["pools"]
    assert pool["group"]["layers"] == [0, 1] and pool["group"]["cache_dtype"] == "fp16"
    assert pool["group"]["layout"]["page_size"] == 32 and pool["mode"] == "full"
    # a block holds one page of K and V of every layer of the group, fp16
    assert pool["block_bytes"] == BASE.num_layers * 2 * BASE.num_kv_heads * 32 * BASE.head_dim * 2


def _set_theta(path, out, theta):
    model = onnx.load(str(path))
    for node in model.graph.node:
        if node.op_type == "PagedKVQKVWrite":
            for a in node.attribute:
                if a.name == "rope_theta":
                    a.CopyFrom(helper.make_attribute("rope_theta", theta))
    onnx.save(model, str(out))
    return out


def test_compare_json_per_step_and_plot(graphs, tmp_path, capsys):
    orig, rew = graphs
    png = tmp_path / "plots" / "compare.png"
    argv = ["compare", str(orig), str(rew), "--prompt-lens", ",".join(map(str, PROMPT_LENS)), "--decode-steps",
            "3", "--chunk-size", "8", "--json", "--plot", str(png)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["prompt_lens"] == PROMPT_LENS and report["chunk_size"] == 8
    steps = report["steps"]
    # chunked prefill: 17 tokens take 3 chunks of 8; then 3 decodes
    assert len(steps) == 3 + 3 and [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    for s in steps:
        logits = s["logits"]
        assert logits["passed"] and 0 <= logits["max_abs"] <= logits["bound"], s
        assert logits["max_rel"] >= 0 and s["argmax_agree"] <= s["rows"]
        for g in s["greedy"]:
            assert g["agree"] == (g["original"] == g["rewritten"]) and not (g["agree"] and g["tie"])
    decodes = [g for s in steps for g in s["greedy"]]
    assert {g["seq"] for g in decodes} == {"s0", "s1"}
    assert len(report["kv"]) == len(PROMPT_LENS) * BASE.num_layers and all(k["passed"] for k in report["kv"])
    image = matplotlib.image.imread(str(png))
    assert image.shape[:2] == (450, 800) and image.std() > 0  # 8 x 4.5 in at 100 dpi, not blank


def test_compare_json_reports_a_wrong_rewrite(graphs, tmp_path, capsys):
    orig, rew = graphs
    broken = _set_theta(rew, tmp_path / "broken.onnx", 500.0)
    assert main(["compare", str(orig), str(broken), "--prompt-lens", "5,17", "--decode-steps", "2", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["passed"] and not report["logits_passed"]
    failed = [s for s in report["steps"] if not s["logits"]["passed"]]
    assert failed and all(s["logits"]["max_abs"] > s["logits"]["bound"] for s in failed)


def test_a_failed_rewrite_leaves_nothing_behind(tmp_path, capsys):
    src = export_synthetic(BASE.replace(head_dim=48), tmp_path / "d48.onnx")  # no plugin kernel for head dim 48
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}  # the graph (and its data file)
    assert main(["rewrite", str(src), "-o", str(tmp_path / "sub" / "out.onnx")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "head_dim" in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before and "d48.onnx" in before


def test_pagemap_creates_its_folder(tmp_path, capsys):
    out = tmp_path / "a" / "b" / "map.png"
    assert main(["pagemap", "--seed", "1", "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert matplotlib.image.imread(str(out)).ndim == 3
    assert sorted(p.name for p in out.parent.iterdir()) == ["map.png"]  # no staging folder left
