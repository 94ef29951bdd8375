"""``pagedkv bench``: sane JSON and a PNG from offline and online runs in-process, the same against a server on
loopback (and failures counted when the server refuses), seeded length distributions and Poisson arrivals, a
prompts file, and one-line errors for bad arguments.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from runtime_support import SMALL, needs_tokenizers, serve_in_thread, synthetic_rewritten, tokenizer_dir

from pagedkv.cli import main
from pagedkv.runtime import LLM
from pagedkv.runtime.bench import LengthDist, arrival_times, synthetic_requests

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    (d / "model.paged.onnx").write_bytes(synthetic_rewritten(SMALL))
    return d / "model.paged.onnx"


def _check_run(run, *, requests: int, output_tokens: int):
    assert run["requests"] == run["completed"] == requests and run["failed"] == 0 and not run["errors"]
    assert run["output_tokens"] == run["expected_output_tokens"] == output_tokens
    assert run["duration_s"] > 0 and run["prompt_tokens"] > 0
    assert run["output_throughput"] == pytest.approx(output_tokens / run["duration_s"])
    assert run["total_throughput"] > run["output_throughput"]
    for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        s = run[metric]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (metric, s)
    assert run["e2e_ms"]["p50"] >= run["ttft_ms"]["p50"]
    per = run["per_request"]
    assert sum(per["output_tokens"]) == output_tokens and len(per["ttft_s"]) == requests
    assert all(e >= t > 0 for t, e in zip(per["ttft_s"], per["e2e_s"]))


def test_bench_offline_and_online_json_and_plot(model, tmp_path, capsys):
    out, png = tmp_path / "res" / "bench.json", tmp_path / "bench.png"
    args = ["bench", str(model), "--backend", "reference", "--num-blocks", "256", "--num-prompts", "6",
            "--input-len", "20", "--output-len", "5", "--len-dist", "normal", "--len-spread", "0.3",
            "--request-rate", "inf,40", "--json", "-o", str(out), "--plot", str(png), "--quiet"]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    offline, online = printed["runs"]
    assert (offline["mode"], offline["request_rate"]) == ("offline", "inf")
    assert (online["mode"], online["request_rate"]) == ("online", 40)
    want = synthetic_requests(6, LengthDist("normal", 20, 0.3), LengthDist("normal", 5, 0.3), 128, seed=0)
    total = sum(r.max_tokens for r in want)
    for run in (offline, online):
        _check_run(run, requests=6, output_tokens=total)
    # Poisson arrivals at 40/s spread 6 requests over ~0.15 s; offline they all start at once
    assert online["duration_s"] > arrival_times(6, 40, 0)[-1]
    # the table, without --json
    assert main(args[:-6] + ["--quiet"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith("# pagedkv bench") and "TTFT ms" in text[1] and len(text) == 5


def test_length_distributions_and_arrivals_are_seeded():
    rng = lambda: np.random.default_rng(3)  # noqa: E731
    assert (LengthDist("fixed", 7).sample(rng(), 5) == 7).all()
    u = LengthDist("uniform", 100, 0.25).sample(rng(), 4000)
    assert u.min() >= 75 and u.max() <= 125 and abs(u.mean() - 100) < 1.5
    n = LengthDist("normal", 100, 0.2).sample(rng(), 4000)
    assert abs(n.mean() - 100) < 1.5 and abs(n.std() - 20) < 1.5 and n.min() >= 1
    assert (LengthDist("normal", 2, 5.0).sample(rng(), 1000) >= 1).all()
    same = LengthDist("uniform", 100, 0.25)
    assert (same.sample(rng(), 50) == same.sample(rng(), 50)).all()
    assert (arrival_times(5, math.inf, 0) == 0).all()
    t = arrival_times(5000, 20.0, 1)
    gaps = np.diff(np.concatenate([[0], t]))
    assert (gaps > 0).all() and abs(gaps.mean() - 0.05) < 0.003 and abs(gaps.std() - 0.05) < 0.004  # exponential
    assert (arrival_times(50, 20.0, 1) == arrival_times(50, 20.0, 1)).all()
    reqs = synthetic_requests(20, LengthDist("fixed", 30), LengthDist("fixed", 10), 50, seed=0, max_model_len=35)
    assert all(len(r.prompt) == 30 and r.max_tokens == 5 and max(r.prompt) < 50 for r in reqs)
    with pytest.raises(ValueError, match="len_spread"):
        LengthDist("uniform", 10, 1.5)


@needs_tokenizers
def test_bench_against_a_server_on_loopback_and_a_prompts_file(tmp_path, capsys):
    pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'pagedkv[serve]')")
    pytest.importorskip("httpx", reason="the serve extra is not installed (pip install 'pagedkv[serve]')")
    d = tokenizer_dir(tmp_path / "model")
    (d / "model.paged.onnx").write_bytes(synthetic_rewritten(SMALL))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello world"}\n{"prompt": "the lazy dog", "max_tokens": 3}\n'
                       '{"input_ids": [5, 6, 7]}\n')
    with LLM(str(d / "model.paged.onnx"), backend="reference", num_blocks=128) as llm:
        with serve_in_thread(llm) as (url, worker):
            args = ["bench", str(d / "model.paged.onnx"), "--url", url, "--num-prompts", "5", "--input-len", "12",
                    "--output-len", "4", "--request-rate", "inf,100", "--json", "--quiet"]
            assert main(args) == 0
            runs = json.loads(capsys.readouterr().out)["runs"]
            for run in runs:
                _check_run(run, requests=5, output_tokens=20)
                assert run["prompt_tokens"] == 5 * 12  # from the server's usage
            assert main(["bench", str(d / "model.paged.onnx"), "--url", url, "--prompts-file", str(prompts),
                         "--output-len", "6", "--json", "--quiet"]) == 0
            (run,) = json.loads(capsys.readouterr().out)["runs"]
            _check_run(run, requests=3, output_tokens=6 + 3 + 6)
        # in-process: the text prompts go through the model directory's tokenizer
        assert worker.metrics()["in_flight"] == 0
    assert main(["bench", str(d / "model.paged.onnx"), "--backend", "reference", "--num-blocks", "64",
                 "--prompts-file", str(prompts), "--output-len", "6", "--json", "--quiet", "--warmup", "0"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    _check_run(run, requests=3, output_tokens=15)


def test_bench_counts_refused_requests_as_failures(model, capsys):
    pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'pagedkv[serve]')")
    with LLM(str(model), backend="reference", num_blocks=128) as llm:
        with serve_in_thread(llm, max_pending=2) as (url, _):
            assert main(["bench", str(model), "--url", url, "--num-prompts", "8", "--input-len", "8",
                         "--output-len", "30", "--json", "--quiet", "--warmup", "0"]) == 1
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert run["failed"] >= 1 and run["completed"] + run["failed"] == 8
    assert any("HTTP 429" in e for e in run["errors"])


@pytest.mark.parametrize("extra,message", [
    (["--request-rate", "0"], "--request-rate: expected > 0, got 0"),
    (["--request-rate", "fast"], "--request-rate: expected a number, got 'fast'"),
    (["--len-dist", "uniform", "--len-spread", "2"], "--len-spread: expected a value in [0, 1], got 2"),
    (["--num-prompts", "0"], "--num-prompts: expected >= 1, got 0"),
    (["--output-len", "0"], "--output-len: expected >= 1, got 0"),
    (["--prompts-file", "BAD"], "prompts.jsonl:1: expected an object"),
    (["--url", "http://127.0.0.1:9", "--prompts-file", "NOPE"], "--prompts-file: "),
], ids=["rate-0", "rate-word", "spread", "num-prompts", "output-len", "prompts-file", "missing-file"])
def test_bench_bad_arguments_are_one_line(model, tmp_path, capsys, extra, message):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"text": "no"}\n')
    extra = [str(bad) if a == "BAD" else str(tmp_path / "none.jsonl") if a == "NOPE" else a for a in extra]
    assert main(["bench", str(model), "--backend", "reference", "--num-blocks", "32", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
