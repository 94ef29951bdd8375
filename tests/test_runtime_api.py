"""The Python API (``LLM``, ``Worker``) and ``pagedkv generate``, on a synthetic decoder with a tokenizer
directory beside it (``runtime_support.tokenizer_dir``: what a Hugging Face model directory holds).

LLM: text, token ids and chat prompts; completions equal the engine's tokens; streaming deltas add up to the
completion; EOS from the directory's generation_config. Worker: submissions from several threads and from
asyncio, abort mid-stream frees the request's blocks, validation errors raise in the caller, a full queue
raises ``WorkerBusy``, close ends what is left; ``call`` runs on the engine thread between steps, and an engine that
fails ends every request with its error and refuses more (``WorkerClosed``). CLI: text streaming, JSON lines from token ids (stdout and an
atomically written file), and one-line usage errors with exit status 2.
"""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest
from runtime_support import EOS, SMALL, needs_tokenizers, synthetic_rewritten, tokenizer_dir

from pagedkv.cli import main
from pagedkv.runtime import LLM, ContextLengthError, SamplingParams, Worker, WorkerBusy, WorkerClosed


pytestmark = needs_tokenizers  # the model directory has a tokenizer; token-id paths are tested without one too


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tokenizer_dir(tmp_path_factory.mktemp("model"))
    (d / "model.paged.onnx").write_bytes(synthetic_rewritten(SMALL))
    return d


def _llm(model_dir, **kw):
    kw.setdefault("backend", "reference")
    kw.setdefault("num_blocks", 128)
    return LLM(str(model_dir / "model.paged.onnx"), **kw)


def test_llm_text_ids_and_chat(model_dir):
    with _llm(model_dir) as llm:
        assert llm.backend == "reference" and llm.tokenizer is not None  # found beside the model
        assert llm.engine.eos_token_ids == {EOS} and llm.engine.max_model_len == 512
        sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
        text, ids, chat = llm.generate(["hello world", llm.tokenizer.encode("hello world"),
                                        {"messages": [{"role": "user", "content": "hello world"}]}], sp)
        assert text.output_ids == ids.output_ids and len(text.output_ids) == 6
        assert text.text == llm.tokenizer.decode(text.output_ids) and text.finish_reason == "length"
        assert chat.prompt_ids == llm.tokenizer.chat([{"role": "user", "content": "hello world"}])
        assert chat.prompt_ids != text.prompt_ids
        one = llm.generate([5, 6, 7], sp)  # a single prompt as token ids
        assert len(one) == 1 and one[0].prompt_ids == [5, 6, 7]
        deltas = list(llm.stream(["hello world", "the lazy dog"], sp, ids=["a", "b"]))
        for rid, expect in (("a", text), ("b", None)):
            mine = [d for d in deltas if d.id == rid]
            assert [d.finished for d in mine] == [False] * (len(mine) - 1) + [True]
            if expect is not None:
                assert sum((d.token_ids for d in mine), []) == expect.output_ids
                assert "".join(d.text for d in mine) == expect.text
        with pytest.raises(ValueError, match="ids: expected 2 distinct request ids"):
            llm.generate(["a", "b"], sp, ids=["x", "x"])
        assert not llm.engine.requests and not llm.executor.manager.sequences


def test_llm_without_tokenizer_takes_token_ids_only(tmp_path):
    (tmp_path / "m.paged.onnx").write_bytes(synthetic_rewritten(SMALL))
    with LLM(str(tmp_path / "m.paged.onnx"), backend="reference", num_blocks=32) as llm:
        assert llm.tokenizer is None
        (c,) = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
        assert len(c.output_ids) == 3 and c.text is None
        with pytest.raises(ValueError, match="text needs a tokenizer"):
            llm.generate("hello")


def test_worker_threads_abort_and_errors(model_dir):
    with _llm(model_dir) as llm:
        expect = {n: llm.generate([n % 50 + 1, 7, 9], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].output_ids
                  for n in range(12)}
        worker = Worker(llm.engine, max_pending=64)
        results = {}

        def client(k):
            for n in range(k, 12, 3):
                handle = worker.submit([n % 50 + 1, 7, 9], SamplingParams(max_new_tokens=8, ignore_eos=True))
                results[n] = handle.result()

        threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert {n: c.output_ids for n, c in results.items()} == expect
        assert all(c.finish_reason == "length" for c in results.values())

        slow = worker.submit([1, 2, 3], SamplingParams(max_new_tokens=400, ignore_eos=True), request_id="slow")
        stream = iter(slow)
        first = next(stream)
        assert first.id == "slow" and not first.finished
        worker.abort("slow")
        rest = list(stream)
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        assert sum(len(d.token_ids) for d in [first, *rest]) < 400
        metrics = worker.metrics()
        assert metrics["kv_blocks_used"] == [0] and metrics["in_flight"] == 0

        with pytest.raises(ContextLengthError, match="context limit of 512"):
            worker.submit([1] * 510, SamplingParams(max_new_tokens=8))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            worker.submit([1, 5000])
        with pytest.raises(KeyError, match="not in flight"):
            worker.stream("nope")
        worker.close()
        with pytest.raises(RuntimeError, match="not accepting requests"):
            worker.submit([1, 2])


def test_worker_busy_and_close_aborts(model_dir):
    with _llm(model_dir) as llm:
        worker = Worker(llm.engine, max_pending=2)
        handles = [worker.submit([1, 2, 3], SamplingParams(max_new_tokens=300, ignore_eos=True)) for _ in range(2)]
        with pytest.raises(WorkerBusy, match="max_pending=2"):
            worker.submit([1, 2, 3])
        worker.close()
        assert [h.result().finish_reason for h in handles] == ["abort", "abort"]
        assert not llm.executor.manager.sequences


def test_worker_call_alive_and_engine_failure(model_dir):
    with _llm(model_dir) as llm:
        worker = Worker(llm.engine)
        handle = worker.submit("hello world", SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert handle.prompt_ids == llm.tokenizer.encode("hello world")
        validated, requests = worker.call(lambda e: (e.manager.validate(), len(e.requests))).result(10)
        assert validated is None and requests in (0, 1)
        with pytest.raises(ZeroDivisionError):
            worker.call(lambda e: 1 / 0).result(10)  # the caller gets its function's exception; the worker goes on
        done = handle.result()
        assert done.prompt_ids == handle.prompt_ids and len(done.output_ids) == 40 and worker.alive

        def broken_step():
            raise RuntimeError("device lost")

        slow = worker.submit([1, 2, 3], SamplingParams(max_new_tokens=400, ignore_eos=True))
        next(iter(slow))  # running
        worker.call(lambda e: setattr(e, "step", broken_step)).result(10)
        last = slow.result()
        assert last.finish_reason == "error" and last.error == "RuntimeError: device lost"
        assert not worker.alive and not llm.executor.manager.sequences
        with pytest.raises(WorkerClosed, match="device lost"):
            worker.submit([1, 2])
        with pytest.raises(WorkerClosed, match="device lost"):
            worker.call(lambda e: None)
        worker.close()


def test_worker_streams_to_asyncio(model_dir):
    with _llm(model_dir) as llm:
        expect = llm.generate("hello there", SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
        worker = Worker(llm.engine)

        async def run():
            loop = asyncio.get_running_loop()
            handles = [worker.submit("hello there", SamplingParams(max_new_tokens=5, ignore_eos=True), loop=loop)
                       for _ in range(3)]
            out = []
            for h in handles:
                tokens, text = [], ""
                async for d in h:
                    tokens += d.token_ids
                    text += d.text
                out.append((tokens, text))
            with pytest.raises(TypeError, match="use `async for`"):
                list(handles[0])
            return out

        got = asyncio.run(run())
        worker.close()
    assert got == [(expect.output_ids, expect.text)] * 3


# ---- the CLI ---------------------------------------------------------------------------------------------
def test_generate_cli_text_and_jsonl(model_dir, tmp_path, capsys):
    model = str(model_dir / "model.paged.onnx")
    assert main(["generate", model, "--backend", "reference", "--prompt", "hello world", "--max-new-tokens", "5",
                 "--ignore-eos", "--num-blocks", "64"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("[length]")
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"id": "a", "input_ids": [5, 6, 7]}\n\n{"id": 9, "input_ids": [1]}\n')
    args = ["generate", model, "--backend", "reference", "--input-ids-file", str(ids), "--max-new-tokens", "4",
            "--ignore-eos", "--jsonl", "--logprobs", "2"]
    assert main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in lines] == ["a", 9] and all(len(r["output_ids"]) == 4 for r in lines)
    assert all(r["finish_reason"] == "length" and len(r["logprobs"]) == 4 for r in lines)
    assert len(lines[0]["logprobs"][0]["top"]) == 2 and isinstance(lines[0]["text"], str)
    target = tmp_path / "out" / "gen.jsonl"
    assert main(args + ["-o", str(target)]) == 0
    assert [json.loads(line) for line in target.read_text().splitlines()] == lines
    assert not list(target.parent.glob(".*partial"))


@pytest.mark.parametrize("extra,message", [
    ([], "give --prompt TEXT (repeatable) or --input-ids-file F.jsonl"),
    (["--prompt", "x", "--top-p", "1.5"], "--top-p: expected a finite number in [0, 1], got 1.5"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens: expected an integer >= 1 or None, got 0"),
    (["--prompt", "x", "--max-new-tokens", "5000"], "context limit of 512 tokens"),
    (["--prompt", "x", "--page-size", "32"], "--page-size: the graph's KV pages hold [16] tokens, not 32"),
    (["--prompt", "x", "--stop-token-ids", "1,x"], "--stop-token-ids[1]: expected an integer"),
    (["--prompt", "x", "-o", "f.jsonl"], "-o/--output: writes JSON lines; add --jsonl"),
    (["--input-ids-file", "IDS", "--tokenizer", "NODIR"], "--tokenizer: 'NODIR' does not exist"),
], ids=["no-prompts", "top-p", "max-new-tokens", "context", "page-size", "stop-ids", "output-needs-jsonl",
        "tokenizer-dir"])
def test_generate_cli_bad_input_is_one_line(model_dir, tmp_path, capsys, extra, message):
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"id": 1, "input_ids": [1, 2]}\n')
    extra = [str(ids) if a == "IDS" else str(tmp_path / "nodir") if a == "NODIR" else a for a in extra]
    message = message.replace("'NODIR'", repr(str(tmp_path / "nodir")))
    assert main(["generate", str(model_dir / "model.paged.onnx"), "--backend", "reference", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("content,message", [
    ("not json\n", "ids.jsonl:1: not JSON"),
    ('{"input_ids": []}\n', "ids.jsonl:1: input_ids must be a non-empty list of token ids >= 0"),
    ('{"id": 1, "input_ids": [1]}\n{"id": 1, "input_ids": [2]}\n', "ids.jsonl:2: id must be a string or an integer, "
                                                                   "unique in the file; got 1"),
    ('{"id": "a", "input_ids": [1, 4000]}\n', "token 4000 at position 1 is outside the vocabulary [0, 128)"),
    ('[1, 2]\n', 'ids.jsonl:1: expected an object {"id": ..., "input_ids": [...]}'),
])
def test_generate_cli_bad_input_ids_file(model_dir, tmp_path, capsys, content, message):
    ids = tmp_path / "ids.jsonl"
    ids.write_text(content)
    assert main(["generate", str(model_dir / "model.paged.onnx"), "--backend", "reference", "--input-ids-file",
                 str(ids), "--jsonl"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_generate_cli_model_errors(tmp_path, capsys):
    bad = tmp_path / "model.txt"
    bad.write_text("x")
    assert main(["generate", str(bad), "--prompt", "x"]) == 2
    assert "is neither a rewritten .onnx nor an engine" in capsys.readouterr().err
    engine = tmp_path / "m.engine"
    engine.write_bytes(b"\0" * 8)
    assert main(["generate", str(engine), "--prompt", "x", "--backend", "reference"]) == 2
    assert "is a TensorRT engine, which only the trt backend runs" in capsys.readouterr().err
    assert main(["generate", str(engine), "--prompt", "x"]) == 2
    assert "needs the rewritten ONNX it was built from" in capsys.readouterr().err
    original = tmp_path / "orig.onnx"
    from pagedkv.onnx_export.synthetic import export_synthetic

    export_synthetic(SMALL, original)
    assert main(["generate", str(original), "--prompt", "x", "--backend", "reference"]) == 2
    assert "is this the output of `pagedkv rewrite`" in capsys.readouterr().err
    np.testing.assert_equal(original.exists(), True)


def test_the_docs_python_example_runs(tmp_path, monkeypatch, capsys):
    """docs/runtime.md's first Python block, on a tiny model and tokenizer under the names it uses."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "runtime.md").read_text()
    block = doc[doc.index("```python") + len("```python"):]
    block = block[:block.index("```")]
    tokenizer_dir(tmp_path / "qwen2-dir")
    (tmp_path / "qwen2.paged.onnx").write_bytes(synthetic_rewritten(SMALL))
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs/runtime.md", "exec"), {})
    out = capsys.readouterr().out
    assert "llm-0" in out and "llm-1" in out and out.count("length") + out.count("stop") >= 2
