"""Quantized caches need scales: calibration (``pagedkv.builder.calibrate``), the rewrite's refusal without scales,
and the validation of every plugin attribute against the capability table (``pagedkv.config``) before anything
is written.

* The calibrated amax per layer equals the largest |present K| / |present V| the original graph produces on the
  prompts (an independent ONNX Runtime run), the scales are amax / 448 (fp8 e4m3) and amax / 127 (int8), and they
  land in each layer's plugin attributes and the report.
* fp8 and int8 caches with calibrated scales pass ``compare`` with the CLI's default tolerance
  (``compare.default_tolerance``), float32 and float16 activations; with scale 1.0 (what the rewrite silently
  used before) the same comparison fails.
* Prompts: JSON lines of token ids, text through a local tokenizer (built here with HF ``tokenizers``), random ids;
  bad lines are named.
* CLI: int8 without scales, --page-size 5000, --k-scale nan, a missing calibration file: one line naming the
  field, exit status 2, no output file.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from pagedkv.builder.calibrate import CalibrationError, CalibrationPlan, calibrate_kv, load_prompts, random_prompts
from pagedkv.builder.compare import compare, default_tolerance
from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
from pagedkv.config import ATTRIBUTE_RANGES, WRITE_PLUGIN_NAME, WriteConfig
from pagedkv.layout import CacheDType
from pagedkv.onnx_export.synthetic import SyntheticConfig, export_synthetic, make_synthetic_model

BASE = SyntheticConfig(num_layers=2, hidden=64, vocab=128, intermediate=128)
PROMPTS = [5, 17, 33]
_MODELS: dict = {}


def original(cfg: SyntheticConfig = BASE) -> onnx.ModelProto:
    if cfg not in _MODELS:
        _MODELS[cfg] = make_synthetic_model(cfg)
    return _MODELS[cfg]


def _present_amax(model: onnx.ModelProto, prompts) -> tuple[np.ndarray, np.ndarray]:
    """max |present K|, |present V| per layer, each prompt one prefill: a plain ONNX Runtime session."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = [o.name for o in session.get_outputs()]
    layers = len([n for n in outputs if n.endswith(".key")])
    k, v = np.zeros(layers), np.zeros(layers)
    for p in prompts:
        feed = {"input_ids": p[None], "attention_mask": np.ones((1, p.size), np.int64),
                "position_ids": np.arange(p.size)[None]}
        for name, info in inputs.items():
            if name.startswith("past_key_values"):
                feed[name] = np.zeros((1, info.shape[1], 0, info.shape[3]), np.float32)
        got = dict(zip(outputs, session.run(None, feed)))
        for i in range(layers):
            k[i] = max(k[i], np.abs(got[f"present.{i}.key"]).max())
            v[i] = max(v[i], np.abs(got[f"present.{i}.value"]).max())
    return k, v


def test_amax_and_scales_follow_the_present_kv():
    model = original()
    prompts = random_prompts(BASE.vocab, num=3, length=40, seed=5)
    cal = calibrate_kv(model, prompts, quiet=True)
    k, v = _present_amax(model, prompts)
    np.testing.assert_allclose(cal.k_amax, k, rtol=1e-6)
    np.testing.assert_allclose(cal.v_amax, v, rtol=1e-6)
    assert (cal.prompts, cal.tokens) == (3, 120)
    assert cal.present == (("present.0.key", "present.0.value"), ("present.1.key", "present.1.value"))
    k8, v8 = cal.scales("fp8")
    np.testing.assert_allclose(k8, k / 448.0, rtol=1e-6)
    np.testing.assert_allclose(v8, v / 448.0, rtol=1e-6)
    ki, vi = cal.scales("int8")
    np.testing.assert_allclose(ki, k / 127.0, rtol=1e-6)
    with pytest.raises(CalibrationError, match="quantized caches"):
        cal.scales("fp16")


@pytest.mark.parametrize("cache", ["fp8", "int8"])
def test_calibrated_scales_reach_every_layer_and_the_report(cache):
    cfg = BASE.replace(num_layers=3, sliding_window=6)
    cal = calibrate_kv(original(cfg), random_prompts(cfg.vocab, num=2, length=24), source="test", quiet=True)
    result = rewrite_model(original(cfg), RewriteOptions(cache_dtype=cache, calibration=cal,
                                                         pool_grouping="per_layer"))
    k, v = cal.scales(cache)
    writes = [n for n in result.model.graph.node if n.op_type == WRITE_PLUGIN_NAME]
    assert len(writes) == 3
    for i, node in enumerate(writes):
        pool = WriteConfig.from_attributes({a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}).pool
        assert pool.cache_dtype == CacheDType.parse(cache)
        assert pool.k_scale == pytest.approx(k[i], rel=1e-6) and pool.v_scale == pytest.approx(v[i], rel=1e-6)
    for i, group in enumerate(result.pool_groups):
        assert group.k_scales[0] == pytest.approx(k[i], rel=1e-6)
    text = str(result.report)
    assert f"cache_dtype={CacheDType.parse(cache).name.lower()}" in text and "page_size=16" in text
    assert "calibrated on 2 prompt(s), 48 tokens (test)" in text and f"k_scale={k[2]:.6g}" in text
    assert result.report.calibration == cal


def _compare_with_cli_tolerance(model, rewritten):
    atol, rtol = default_tolerance(rewritten, model)
    return compare(model, rewritten, prompt_lens=PROMPTS, decode_steps=8, chunk_size=8, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [None, "fp16"], ids=["float32", "fp16"])
@pytest.mark.parametrize("cache", ["fp8", "int8"])
@pytest.mark.parametrize("cfg", [BASE, BASE.replace(num_kv_heads=1, qkv_bias=True, fused_qkv=True),
                                 BASE.replace(sliding_window=8, qk_norm=True)], ids=["gqa", "mqa-bias", "window-qknorm"])
def test_quantized_caches_pass_compare_once_calibrated(cfg, cache, dtype):
    model = original(cfg)
    rewritten = rewrite_model(model, RewriteOptions(cache_dtype=cache, calibration=CalibrationPlan(), dtype=dtype),
                              quiet=True).model
    report = _compare_with_cli_tolerance(model, rewritten)
    assert report.passed, str(report)


@pytest.mark.parametrize("cache", ["fp8", "int8"])
def test_unit_scales_fail_where_calibrated_ones_pass(cache):
    """What the rewrite did before: scale 1.0 for every layer. int8 rounds every value to an integer; e4m3 with
    scale 1 stores values of ~1-4 with 3 mantissa bits but also flushes the small ones."""
    model = original()
    blunt = rewrite_model(model, RewriteOptions(cache_dtype=cache, k_scale=1.0, v_scale=1.0)).model
    report = _compare_with_cli_tolerance(model, blunt)
    if cache == "int8":
        assert not report.passed, str(report)
    calibrated = rewrite_model(model, RewriteOptions(cache_dtype=cache, calibration=CalibrationPlan()), quiet=True)
    better = _compare_with_cli_tolerance(model, calibrated.model)
    assert better.passed and better.max_abs < report.max_abs, (str(better), str(report))


# ---- prompts ----------------------------------------------------------------------------------------------
def test_prompts_from_json_lines_and_text(tmp_path):
    ids = tmp_path / "calib.jsonl"
    ids.write_text('{"input_ids": [1, 2, 3]}\n\n{"input_ids": [4, 5]}\n', encoding="utf-8")
    assert [p.tolist() for p in load_prompts(ids)] == [[1, 2, 3], [4, 5]]

    tokenizers = pytest.importorskip("tokenizers", reason="HF tokenizers (the export extra) not installed")
    Tokenizer, models, pre_tokenizers = tokenizers.Tokenizer, tokenizers.models, tokenizers.pre_tokenizers

    vocab = {"[UNK]": 0, "the": 1, "cache": 2, "holds": 3, "keys": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    text = tmp_path / "calib.txt"
    text.write_text("the cache holds keys\nthe values\n", encoding="utf-8")
    assert [p.tolist() for p in load_prompts(text, tok_dir)] == [[1, 2, 3, 4], [1, 0]]
    records = tmp_path / "text.jsonl"
    records.write_text('{"text": "keys cache"}\n', encoding="utf-8")
    assert [p.tolist() for p in load_prompts(records, tok_dir)] == [[4, 2]]


@pytest.mark.parametrize("content, message", [
    ('{"input_ids": [1, -2]}\n', r"calib.jsonl:1: input_ids must be a non-empty list of integers >= 0"),
    ('{"input_ids": [1]}\n{"ids": [1]}\n', r"calib.jsonl:2: expected"),
    ('{"input_ids": [1]\n', r"calib.jsonl:1: not a JSON object"),
    ('\n\n', r"no prompts found"),
    ('{"text": "hello"}\n', r"calib.jsonl:1: text prompts need a tokenizer"),
])
def test_bad_prompt_files_are_named(tmp_path, content, message):
    path = tmp_path / "calib.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(CalibrationError, match=message):
        load_prompts(path)


def test_token_ids_past_the_vocabulary_are_refused():
    with pytest.raises(CalibrationError, match="vocabulary size 128"):
        calibrate_kv(original(), [np.asarray([1, 500])], quiet=True)


# ---- options and CLI: refused before anything runs, one line, exit 2, nothing written ------------------------
@pytest.mark.parametrize("options, message", [
    (dict(cache_dtype="int8"), r"cache_dtype=int8: a quantized cache needs K and V scales; calibrate .*--calibrate"),
    (dict(cache_dtype="fp8", k_scale=0.1), r"needs K and V scales"),
    (dict(cache_dtype="fp8", k_scale=0.1, v_scale=0.1, calibration=CalibrationPlan()), r"not both"),
    (dict(k_scale=0.5, v_scale=0.5), r"only quantized caches \(fp8, int8\) take scales; cache_dtype is fp16"),
    (dict(page_size=5000), r"page_size: expected a value in \[1, 4096\], got 5000"),
    (dict(page_size=0), r"page_size: expected a value in \[1, 4096\], got 0"),
    (dict(cache_dtype="fp8", k_scale=float("nan"), v_scale=1.0), r"k_scale: expected a finite value > 0"),
    (dict(cache_dtype="int8", k_scale=1.0, v_scale=1e39), r"v_scale: expected a finite value > 0 \(float32\)"),
    (dict(max_blocks=2**30), r"max_blocks: expected a value in \[1, 134217727\]"),
    (dict(dtype="fp64"), r"dtype: expected one of"),
])
def test_options_are_validated_against_the_capability_table(options, message):
    with pytest.raises(ValueError, match=message):
        RewriteOptions(**options)


def test_plugin_configs_check_every_range():
    assert ATTRIBUTE_RANGES["page_size"] == (1, 4096)
    pool = rewrite_model(original()).pool_groups[0].pool_config(0, 0)
    import dataclasses

    with pytest.raises(ValueError, match=r"num_q_heads: expected a value in \[1, 1024\], got 2048"):
        WriteConfig(num_q_heads=2048, pool=dataclasses.replace(pool, num_kv_heads=1024))
    with pytest.raises(ValueError, match=r"rope_theta: expected a finite value > 0"):
        WriteConfig(num_q_heads=4, pool=pool, rope=dataclasses.replace(WriteConfig(4, pool).rope, theta=-1.0))


@pytest.mark.parametrize("argv, message", [
    (["--cache-dtype", "int8"], "cache_dtype=int8: a quantized cache needs K and V scales; calibrate them on the "
                                "original graph (--calibrate [--calib-data FILE]) or give --k-scale and --v-scale"),
    (["--page-size", "5000"], "--page-size: expected a value in [1, 4096], got 5000"),
    (["--cache-dtype", "fp8", "--k-scale", "nan", "--v-scale", "1"], "--k-scale: expected a finite value > 0"),
    (["--cache-dtype", "int8", "--calib-data", "missing.jsonl"], "calib-data: 'missing.jsonl' does not exist"),
    (["--tokenizer", "."], "tokenizer: only used with --calib-data"),
])
def test_cli_bad_inputs_are_one_line_exit_2_and_leave_nothing(argv, message, tmp_path, capsys, monkeypatch):
    from pagedkv.cli import main

    monkeypatch.chdir(tmp_path)
    src = export_synthetic(BASE, tmp_path / "orig.onnx")
    out = tmp_path / "out.onnx"
    assert main(["rewrite", str(src), "-o", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pagedkv rewrite: ") and message in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["orig.onnx", "orig.onnx.data"]


def test_cli_calibrates_from_a_file_and_reports_json(tmp_path, capsys):
    from pagedkv.cli import main

    src = export_synthetic(BASE, tmp_path / "orig.onnx")
    data = tmp_path / "calib.jsonl"
    rng = np.random.default_rng(0)
    data.write_text("".join(json.dumps({"input_ids": rng.integers(0, 128, 30).tolist()}) + "\n" for _ in range(4)),
                    encoding="utf-8")
    out = tmp_path / "int8.onnx"
    assert main(["rewrite", str(src), "-o", str(out), "--cache-dtype", "int8", "--calib-data", str(data),
                 "--dtype", "fp16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["report"]
    assert report["cache_dtype"] == "int8" and report["page_size"] == 16 and report["dtype"] == "float16"
    assert report["calibration"]["prompts"] == 4 and report["calibration"]["tokens"] == 120
    assert report["scales"].startswith("calibrated on 4 prompt(s), 120 tokens") and "amax / 127" in report["scales"]
    amax = report["calibration"]["k_amax"]
    scales = [layer["write"]["pool"]["k_scale"] for layer in report["layers"]]
    np.testing.assert_allclose(scales, np.asarray(amax) / 127, rtol=1e-6)
    assert main(["compare", str(src), str(out), "--prompt-lens", "5,17", "--decode-steps", "8"]) == 0
    assert "PASSED" in capsys.readouterr().out
