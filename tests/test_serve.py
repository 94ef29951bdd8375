"""``pagedkv serve``: the OpenAI-compatible server, on loopback, over a synthetic decoder with a tokenizer beside it.

Completions and chat, streaming and not, equal ``LLM.generate`` on a second engine for the same seeds (token ids,
text, logprobs, usage); every bad request gets a 4xx in OpenAI's error shape and leaves nothing behind (the KV
validator is clean, every block back in the pool); a full queue answers 429, a stopped engine 503; a client that
disconnects — mid-stream or waiting for a whole completion — aborts its request and its blocks come back; N
clients x M requests at once all get their own answers within a time limit; the CLI verb starts, answers and
refuses bad arguments in one line.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time

import pytest
from runtime_support import (SMALL, assert_nothing_left, metric_values, needs_tokenizers, serve_in_thread,
                             sse_events, synthetic_rewritten, tokenizer_dir)

pytest.importorskip("starlette", reason="the serve extra is not installed (pip install 'pagedkv[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'pagedkv[serve]')")
httpx = pytest.importorskip("httpx", reason="the serve extra is not installed (pip install 'pagedkv[serve]')")

from pagedkv.cli import main  # noqa: E402
from pagedkv.runtime import LLM, SamplingParams  # noqa: E402

pytestmark = [needs_tokenizers, pytest.mark.timeout(120)]
NAME = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tokenizer_dir(tmp_path_factory.mktemp("model"))
    (d / "model.paged.onnx").write_bytes(synthetic_rewritten(SMALL))
    return d


def _llm(model_dir, **kw):
    kw.setdefault("num_blocks", 128)
    return LLM(str(model_dir / "model.paged.onnx"), backend="reference", debug_validate=True, **kw)


@pytest.fixture(scope="module")
def expected(model_dir):
    """A second engine on the same model: what LLM.generate answers."""
    with _llm(model_dir) as llm:
        yield llm


@contextlib.contextmanager
def serving(model_dir, *, max_pending: int = 64, **llm_kw):
    """A server on 127.0.0.1 (a free port) in a thread: yields (base URL, worker)."""
    with _llm(model_dir, **llm_kw) as llm, serve_in_thread(llm, model_name=NAME, max_pending=max_pending) as s:
        yield s


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(model_dir) as s:
        yield s


SEEDED = dict(temperature=0.8, top_p=0.9, top_k=20, seed=7)


# ---- answers equal LLM.generate --------------------------------------------------------------------------
def test_completions_equal_llm_generate(server, expected):
    url, worker = server
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True, **SEEDED)
    want_text = expected.generate("hello world", sp)[0]
    want_ids = expected.generate([5, 6, 7, 8], sp)[0]
    with httpx.Client(base_url=url, timeout=30) as client:
        r = client.post("/v1/completions", json={"model": NAME, "prompt": "hello world", "max_tokens": 6,
                                                 "ignore_eos": True, "return_token_ids": True, **SEEDED})
        assert r.status_code == 200, r.text
        body = r.json()
        (choice,) = body["choices"]
        assert choice["token_ids"] == want_text.output_ids and choice["text"] == want_text.text
        assert choice["finish_reason"] == "length" and body["object"] == "text_completion" and body["model"] == NAME
        assert body["prompt_token_ids"] == [want_text.prompt_ids]
        assert body["usage"] == {"prompt_tokens": len(want_text.prompt_ids), "completion_tokens": 6,
                                 "total_tokens": len(want_text.prompt_ids) + 6}
        # a batch of prompts (text and token ids): one choice per prompt, in order
        r = client.post("/v1/completions", json={"prompt": [[5, 6, 7, 8], [5, 6, 7, 8]], "max_tokens": 6,
                                                 "ignore_eos": True, "return_token_ids": True, **SEEDED})
        assert [c["index"] for c in r.json()["choices"]] == [0, 1]
        assert [c["token_ids"] for c in r.json()["choices"]] == [want_ids.output_ids] * 2
        # greedy: temperature 0
        greedy = expected.generate("the lazy dog", SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
        r = client.post("/v1/completions", json={"prompt": "the lazy dog", "max_tokens": 5, "temperature": 0,
                                                 "ignore_eos": True})
        assert r.json()["choices"][0]["text"] == greedy.text
    assert_nothing_left(worker)


def test_streaming_completions_equal_llm_generate(server, expected):
    url, worker = server
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2, **SEEDED)
    want = expected.generate("paged attention", sp)[0]
    with httpx.Client(base_url=url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={
                "prompt": "paged attention", "max_tokens": 8, "ignore_eos": True, "logprobs": 2, "stream": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}, **SEEDED}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    chunks = [e["choices"][0] for e in events[:-2]]
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert sum((c["token_ids"] for c in chunks), []) == want.output_ids
    assert "".join(c["text"] for c in chunks) == want.text
    logprobs = [lp for c in chunks if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
    assert logprobs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-6)
    tops = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["top_logprobs"]]
    assert len(tops) == 8 and all(len(t) <= 2 for t in tops)
    assert_nothing_left(worker)


def test_chat_equals_llm_chat(server, expected):
    url, worker = server
    messages = [{"role": "user", "content": "hello there"}]
    sp = SamplingParams(max_new_tokens=7, ignore_eos=True, logprobs=1, **SEEDED)
    want = expected.generate({"messages": messages}, sp)[0]
    request = {"messages": messages, "max_completion_tokens": 7, "ignore_eos": True, "logprobs": True,
               "top_logprobs": 1, "return_token_ids": True, **SEEDED}
    with httpx.Client(base_url=url, timeout=30) as client:
        body = client.post("/v1/chat/completions", json=request).json()
        (choice,) = body["choices"]
        assert body["object"] == "chat.completion"
        assert choice["message"] == {"role": "assistant", "content": want.text}
        assert choice["token_ids"] == want.output_ids and choice["finish_reason"] == "length"
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(
            [lp.logprob for lp in want.logprobs], abs=1e-6)
        assert body["usage"]["prompt_tokens"] == len(want.prompt_ids)
        # content as a list of text parts is the same chat
        parts = dict(request, messages=[{"role": "user", "content": [{"type": "text", "text": "hello "},
                                                                     {"type": "text", "text": "there"}]}])
        assert client.post("/v1/chat/completions", json=parts).json()["choices"][0]["token_ids"] == want.output_ids
        with client.stream("POST", "/v1/chat/completions", json=dict(request, stream=True)) as r:
            events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["delta"].get("content", "") for c in chunks) == want.text
    assert sum((c.get("token_ids", []) for c in chunks), []) == want.output_ids
    assert chunks[-1]["finish_reason"] == "length"
    assert_nothing_left(worker)


def test_stop_strings_and_eos(server, expected):
    url, worker = server
    greedy = expected.generate("hello world", SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    stop = greedy.text[3:5]  # a string the greedy output contains
    want = expected.generate("hello world", SamplingParams(max_new_tokens=12, ignore_eos=True, stop=stop))[0]
    assert want.finish_reason == "stop" and stop not in want.text
    with httpx.Client(base_url=url, timeout=30) as client:
        for stream in (False, True):
            request = {"prompt": "hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                       "stop": [stop], "stream": stream}
            if stream:
                with client.stream("POST", "/v1/completions", json=request) as r:
                    chunks = [e["choices"][0] for e in sse_events(r)[:-1]]
                text, reason = "".join(c["text"] for c in chunks), chunks[-1]["finish_reason"]
            else:
                choice = client.post("/v1/completions", json=request).json()["choices"][0]
                text, reason = choice["text"], choice["finish_reason"]
            assert (text, reason) == (want.text, "stop")
    assert_nothing_left(worker)


# ---- bad requests ----------------------------------------------------------------------------------------
BAD = [  # (path, body, status, param, code, message part)
    ("/v1/completions", b"{not json", 400, None, "invalid_json", "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json", "must be a JSON object"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found", "'gpt-4' does not exist"),
    ("/v1/completions", {"prompt": "hello " * 600}, 400, "prompt", "context_length_exceeded", "context limit of 512"),
    ("/v1/completions", {"prompt": [1] * 500, "max_tokens": 100}, 400, "prompt", "context_length_exceeded",
     "exceed the context limit"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", None, "expected an integer >= 1"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature", None, "finite number >= 0"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", None, "in [0, 1]"),
    ("/v1/completions", {"prompt": "x", "top_k": -3}, 400, "top_k", None, "integer >= 0"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", None, "in [-2, 2]"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", None, "> 0"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None, "valid number"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed", None, "[0, 2**64)"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", None, "exceeds the 20 top logprobs"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n", "unsupported", "only n=1"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", "unsupported", "not supported"),
    ("/v1/completions", {"prompt": [1, 2, 999]}, 400, "prompt", None, "outside the vocabulary"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None, "empty"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", None, "Field required"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None, "at least 1 item"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages.0.role", None, "Field required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", None, "needs logprobs: true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools", "unsupported", "not supported"),
    ("/v1/nothing", {}, 404, None, None, "Not Found"),
]


@pytest.mark.parametrize("path,body,status,param,code,message", BAD,
                         ids=[f"{i}-{b[0].rsplit('/', 1)[-1]}-{b[3] or b[4] or 'body'}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_errors_and_leak_nothing(server, path, body, status, param, code, message):
    url, worker = server
    with httpx.Client(base_url=url, timeout=30) as client:
        if isinstance(body, bytes):
            r = client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code and message in error["message"], error
    assert_nothing_left(worker)


def test_wrong_method_and_models_and_health(server):
    url, worker = server
    with httpx.Client(base_url=url, timeout=30) as client:
        r = client.get("/v1/completions")
        assert r.status_code == 405 and "Method Not Allowed" in r.json()["error"]["message"]
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [NAME] and models["data"][0]["max_model_len"] == 512
        assert client.get("/health").json() == {"status": "ok"}


# ---- overload, a stopped engine, disconnects -------------------------------------------------------------
def test_full_queue_answers_429_and_stopped_engine_503(model_dir):
    long = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with serving(model_dir, max_pending=2) as (url, worker):
        with httpx.Client(base_url=url, timeout=30) as a, httpx.Client(base_url=url, timeout=30) as b:
            with a.stream("POST", "/v1/completions", json=long) as ra, \
                    b.stream("POST", "/v1/completions", json=long) as rb:
                assert ra.status_code == rb.status_code == 200
                with httpx.Client(base_url=url, timeout=30) as c:
                    r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 429 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "rate_limit_exceeded" and "max_pending=2" in r.text
        assert_nothing_left(worker)  # both streams were closed unread: aborted
        with httpx.Client(base_url=url, timeout=30) as c:
            assert 'pagedkv_requests_rejected_total{status="429"} 1.0' in c.get("/metrics").text
            worker.close()
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"
            assert c.get("/health").status_code == 503


def _finished(url, reason: str) -> float:
    name = f'pagedkv_requests_finished_total{{finish_reason="{reason}"}}'
    with httpx.Client(base_url=url, timeout=30) as client:
        return metric_values(client.get("/metrics").text).get(name, 0.0)


def test_disconnect_mid_stream_aborts_and_frees_kv(model_dir):
    with serving(model_dir) as (url, worker):
        with httpx.Client(base_url=url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 480,
                                                                "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                used = worker.metrics()["kv_blocks_used"]
                assert used[0] > 0 and worker.metrics()["running"] == 1
            # leaving the block closed the connection mid-stream
        assert_nothing_left(worker)
        assert _finished(url, "abort") == 1 and _finished(url, "length") == 0
        assert worker.metrics()["steps"] < 240  # the engine stopped it: 480 tokens would take 480 steps


def test_disconnect_while_waiting_for_a_completion_aborts(model_dir):
    with serving(model_dir) as (url, worker):
        with httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=0.3)) as client:
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 480, "ignore_eos": True})
        assert_nothing_left(worker)
        assert _finished(url, "abort") == 1 and _finished(url, "length") == 0
        assert worker.metrics()["steps"] < 240  # the engine stopped it: 480 tokens would take 480 steps


# ---- concurrent clients ----------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_concurrent_clients_on_loopback(server, expected):
    url, worker = server
    clients, per_client = 4, 3
    prompts = {(c, m): [c + 1, m + 2, 9, 11] for c in range(clients) for m in range(per_client)}
    want = {k: expected.generate(p, SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.7,
                                                   seed=100 + k[0] * 10 + k[1]))[0].output_ids
            for k, p in prompts.items()}
    got, errors = {}, []

    def client(c):
        try:
            with httpx.Client(base_url=url, timeout=30) as http:
                for m in range(per_client):
                    request = {"prompt": prompts[c, m], "max_tokens": 6, "ignore_eos": True, "temperature": 0.7,
                               "seed": 100 + c * 10 + m, "return_token_ids": True, "stream": bool(m % 2)}
                    if request["stream"]:
                        with http.stream("POST", "/v1/completions", json=request) as r:
                            got[c, m] = sum((e["choices"][0]["token_ids"] for e in sse_events(r)[:-1]), [])
                    else:
                        got[c, m] = http.post("/v1/completions", json=request).json()["choices"][0]["token_ids"]
        except Exception as exc:  # reported below, with the client
            errors.append((c, repr(exc)))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "clients still waiting after 60 s"
    assert not errors and got == want
    assert time.monotonic() - start < 60
    assert_nothing_left(worker)
    with httpx.Client(base_url=url, timeout=30) as http:
        metrics = http.get("/metrics").text
    assert "pagedkv_time_to_first_token_seconds_count" in metrics
    assert 'pagedkv_kv_blocks_total{group="0"} 128.0' in metrics


def test_metrics_count_tokens_and_latencies(model_dir):
    with serving(model_dir) as (url, worker):
        with httpx.Client(base_url=url, timeout=30) as client:
            for n in (3, 5):
                assert client.post("/v1/completions", json={"prompt": [4, 5, 6], "max_tokens": n,
                                                            "ignore_eos": True}).status_code == 200
            text = client.get("/metrics").text
    values = metric_values(text)
    assert values["pagedkv_generation_tokens_total"] == 8 and values["pagedkv_prompt_tokens_total"] == 6
    assert values["pagedkv_time_to_first_token_seconds_count"] == 2
    assert values["pagedkv_inter_token_latency_seconds_count"] == 6  # every token after each first
    assert values["pagedkv_e2e_request_latency_seconds_count"] == 2
    assert values['pagedkv_requests_finished_total{finish_reason="length"}'] == 2
    assert values["pagedkv_requests_running"] == 0 and values['pagedkv_kv_blocks_used{group="0"}'] == 0
    assert values["pagedkv_engine_steps_total"] >= 5


# ---- the CLI verb ----------------------------------------------------------------------------------------
def test_serve_cli_starts_answers_and_stops(model_dir):
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", str(model_dir / "model.paged.onnx"), "--backend",
           "reference", "--num-blocks", "64", "--port", "0", "--served-model-name", NAME]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"pagedkv serve: {NAME!r} on http://127.0.0.1:"), (line, proc.stderr.read())
        base = line.split(" on ")[1].split("/v1")[0]
        with httpx.Client(base_url=base, timeout=30) as client:
            assert client.get("/health").json() == {"status": "ok"}
            r = client.post("/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, proc.stderr.read()


@pytest.mark.parametrize("extra,message", [
    (["--port", "70000"], "--port: expected a value in [0, 65535], got 70000"),
    (["--max-pending", "0"], "--max-pending: expected >= 1, got 0"),
    (["--host", "203.0.113.7"], "--host/--port: cannot bind 203.0.113.7:0"),
    (["--num-blocks", "0"], "--num-blocks: expected >= 1, got 0"),
], ids=["port", "max-pending", "host", "num-blocks"])
def test_serve_cli_bad_arguments_are_one_line(model_dir, capsys, extra, message):
    args = ["serve", str(model_dir / "model.paged.onnx"), "--backend", "reference", "--port", "0", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_serve_cli_missing_model(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "none.onnx")]) == 2
    assert "model: " in capsys.readouterr().err



def test_serve_without_the_extra_says_what_to_install(model_dir, monkeypatch, capsys):
    from pagedkv.runtime import serve

    monkeypatch.setattr(serve, "SERVE_MODULES", serve.SERVE_MODULES + ("no_such_module_for_pagedkv",))
    assert main(["serve", str(model_dir / "model.paged.onnx"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "serving needs no_such_module_for_pagedkv (pip install 'pagedkv[serve]')" in err and err.count("\n") == 1
