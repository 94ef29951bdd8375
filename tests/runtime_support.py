"""Helpers shared by the runtime tests: tiny rewritten models, a tiny tokenizer directory, the Hugging Face
comparison scenario.

``synthetic_rewritten(cfg, **options)`` rewrites a synthetic decoder once per (config, options) and returns the
serialized model (bytes: every test opens its own executor on it). ``tokenizer_dir(path, vocab)`` writes a BPE
tokenizer trained here on a few sentences, small enough for the tiny models' vocabularies, with a chat
template, a generation_config (EOS) and a config (context length): what a Hugging Face model directory holds.
``serve_in_thread(llm)`` runs ``pagedkv serve``'s app for an ``LLM`` on 127.0.0.1 (a free port) in a thread;
``assert_nothing_left(worker)``, ``sse_events(response)`` and ``metric_values(text)`` check what it leaves and
read what it answers (tests/test_serve.py, tests/gpu/test_serve_gpu.py).
``hf_scenario(family, tmp, backend=..., tolerance=...)`` runs one engine over a tiny random HF model (ragged
batch, chunked prefill mixed with decodes, arrivals mid-stream, a shared prefix) and compares every request's
greedy tokens with ``model.generate`` of its prompt alone (tests/test_runtime_hf.py, tests/gpu/).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
from pagedkv.onnx_export.synthetic import SyntheticConfig, make_synthetic_model

TINY = SyntheticConfig(num_layers=1, hidden=64, num_heads=2, num_kv_heads=1, head_dim=64, vocab=64, intermediate=64)
SMALL = SyntheticConfig(num_layers=2, hidden=64, vocab=128, intermediate=128)
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there",
          "paged attention with a kv cache is fast", "stop here. then go on"]
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
EOS = 2  # "</s>"
needs_tokenizers = pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                                      reason="Hugging Face tokenizers not installed (the `text` extra)")


@functools.lru_cache(maxsize=None)
def synthetic_rewritten(cfg: SyntheticConfig = SMALL, **options) -> bytes:
    return rewrite_model(make_synthetic_model(cfg), RewriteOptions(**options)).model.SerializeToString()


def tokenizer_dir(path: Path, vocab: int = 128, max_positions: int = 512) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                                             limit_alphabet=40, show_progress=False))
    assert tok.get_vocab_size() <= vocab and tok.token_to_id("</s>") == EOS
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": max_positions}))
    return path


def random_prompts(rng: np.random.Generator, lengths, vocab: int) -> list[np.ndarray]:
    return [rng.integers(0, vocab, int(n)) for n in lengths]


@contextlib.contextmanager
def serve_in_thread(llm, *, model_name: str = "tiny", max_pending: int = 64):
    """The OpenAI-compatible server over ``llm``'s engine (a ``Worker``), uvicorn on 127.0.0.1 at a free port, in
    a thread: yields (base URL, worker); stops both at the end."""
    import uvicorn

    from pagedkv.runtime.api import Worker
    from pagedkv.runtime.serve import bind
    from pagedkv.runtime.server import create_app

    worker = Worker(llm.engine, max_pending=max_pending)
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(worker, model_name=model_name), log_level="error",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", worker
    finally:
        server.should_exit = True
        thread.join(10)
        worker.close()
        sock.close()



def assert_nothing_left(worker, timeout: float = 20.0) -> None:
    """Nothing left behind by a served engine: no request in flight, every KV block back in the pool, the KV
    validator clean (run on the engine thread, between steps). Waits for aborts still in the worker's inbox."""
    deadline = time.monotonic() + timeout
    while True:
        state = worker.call(lambda e: (e.manager.validate(), len(e.requests), list(e.manager.sequences),
                                       [nb - e.manager.num_free(g) for g, nb in enumerate(e.manager.num_blocks)])
                            ).result(10)
        metrics = worker.metrics()
        if (state[1:] == (0, [], [0] * len(state[3]))) and metrics["in_flight"] == 0:
            return
        assert time.monotonic() < deadline, f"left behind: requests {state[1]}, sequences {state[2]}, " \
                                            f"blocks used {state[3]}, in flight {metrics['in_flight']}"
        time.sleep(0.02)


def sse_events(response) -> list:
    """The data payloads of a server-sent event stream (an httpx streaming response), ``[DONE]`` as the string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric_values(text: str) -> dict[str, float]:
    """The samples of a Prometheus text page by their name as written there (``name{label="value"}``)."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}

# ---- the Hugging Face scenario -------------------------------------------------------------------------
HF_NEW_TOKENS = 10
HF_PROMPT_LENS = (5, 17, 33, 12, 40)
HF_SHARED_TAILS = (2, 9, 4)
HF_ARRIVALS = {0: [0, 5, 1], 2: [2, 3], 9: [4, 6, 7]}  # 5 brings the shared prefix; 6, 7 reuse it once cached


def compared_total() -> int:
    return (len(HF_PROMPT_LENS) + len(HF_SHARED_TAILS)) * HF_NEW_TOKENS


def _hf_greedy(model, prompt):
    """HF greedy tokens of one prompt and the logits [steps, vocab] that chose them."""
    import torch

    ids = torch.as_tensor(prompt, dtype=torch.long)[None]
    with torch.no_grad():  # (an explicit mask: generate would otherwise mask prompt tokens equal to pad_token_id)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=HF_NEW_TOKENS,
                             min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), np.stack([lg[0].double().numpy() for lg in out.logits])


def hf_scenario(family: str, tmp: Path, *, backend: str, tolerance, cache_dtype: str = "fp16") -> tuple[int, int]:
    """Run the scenario (module docstring); returns (tokens compared equal, ties). A differing token must be a
    near-tie in HF's own logits (top-2 gap within ``tolerance`` = (atol, rtol) on the logits' scale): it is
    reported and the rest of that request is not compared (its inputs differ from then on)."""
    from pagedkv.onnx_export import hf
    from pagedkv.runtime import Engine, OrtExecutor, SamplingParams, SchedulerConfig

    model = hf.load_model(family, seed=0)
    model.generation_config.eos_token_id = None
    path = tmp / f"{family}.onnx"
    hf.export_model(model, path, exporter="legacy", verify=False, source=family)
    rewritten = rewrite_model(str(path), RewriteOptions(cache_dtype=cache_dtype)).model
    vocab = int(model.get_output_embeddings().weight.shape[0])
    rng = np.random.default_rng(11)
    shared = rng.integers(0, vocab, 36)
    prompts = [rng.integers(0, vocab, n) for n in HF_PROMPT_LENS]
    prompts += [np.concatenate([shared, rng.integers(0, vocab, n)]) for n in HF_SHARED_TAILS]
    reuse = family != "mistral"  # a windowed model: prefix reuse is off (its early pages leave the cache)
    with OrtExecutor(rewritten.SerializeToString(), backend=backend, num_blocks=64,
                     manager_kwargs={"enable_prefix_reuse": reuse, "debug_validate": True}) as ex:
        engine = Engine(ex, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, chunk_size=8))
        got, step = {}, 0
        while step <= max(HF_ARRIVALS) or engine.has_unfinished:
            for i in HF_ARRIVALS.get(step, []):
                got[i] = engine.add_request(i, prompts[i], SamplingParams(max_new_tokens=HF_NEW_TOKENS))
            engine.step()
            step += 1
        if reuse:
            assert engine.scheduler.stats.prefix_tokens_reused >= 2 * 32
        assert not ex.manager.sequences
    atol, rtol = tolerance
    compared = ties = 0
    for i, prompt in enumerate(prompts):
        want, logits = _hf_greedy(model, prompt)
        ours = got[i].output
        assert len(ours) == HF_NEW_TOKENS
        for j, (a, b) in enumerate(zip(want, ours)):
            if a != b:
                gap = logits[j, a] - logits[j, b]
                tol = atol + rtol * np.abs(logits[j]).max()
                assert gap <= tol, (f"{family} request {i}: token {j} is {b}, HF chose {a} with a lead of "
                                    f"{gap:.3g} (> {tol:.3g}: not a tie)")
                ties += 1
                print(f"{family} ({backend}) request {i}: tie at token {j} ({a} vs {b}, gap {gap:.2e})")
                break
            compared += 1
    return compared, ties
