"""``pagedkv generate MODEL``: prompts in, generated text (or token ids) out, through ``pagedkv.runtime.LLM``.

    pagedkv generate llama.paged.onnx --tokenizer llama-dir --prompt "Hello" --max-new-tokens 32
    pagedkv generate llama.paged.onnx --input-ids-file prompts.jsonl --jsonl -o out.jsonl --temperature 0.8
    pagedkv generate llama.engine --graph llama.paged.onnx --prompt "Hi" --chat      # TensorRT

MODEL is a rewritten ``.onnx`` or an engine. Prompts: ``--prompt TEXT`` (repeatable; ``--chat`` sends each as a
user message through the chat template) with ``--tokenizer DIR`` or the model's own directory, or token ids
from ``--input-ids-file F.jsonl`` (lines ``{"id": ..., "input_ids": [...]}``). Text streams to the terminal as
it is generated (one prompt) or each completion is printed when done (several); ``--jsonl`` writes one line
``{"id", "output_ids", "text", "finish_reason"}`` per prompt instead, to stdout or ``-o FILE`` (written
atomically). Bad input is one line naming it, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pagedkv.userio import (UsageError, atomic_output, check_input_dir, check_input_file, check_int,
                            option_error, parse_int_list)

DEFAULT_MAX_NEW_TOKENS = 32


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """MODEL, --graph, --tokenizer: what ``open_llm`` opens (generate, serve, bench)."""
    parser.add_argument("model", help="rewritten .onnx (pagedkv rewrite) or TensorRT engine (pagedkv build)")
    parser.add_argument("--graph", default=None, help="the rewritten .onnx an engine was built from (default: "
                                                      "beside the engine)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's directory)")


def add_engine_arguments(parser: argparse.ArgumentParser, *, max_num_seqs: int = 64) -> None:
    """The backend, the pools and the scheduler's limits (``LLM``'s arguments): generate, serve, bench."""
    from pagedkv.runtime.api import BACKENDS
    from pagedkv.runtime.scheduler import PREEMPTION_MODES

    engine = parser.add_argument_group("engine")
    engine.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto: engine -> trt; graph -> cuda with a GPU, else reference")
    engine.add_argument("--page-size", type=int, default=None,
                        help="check: the graph's page size (fixed at `pagedkv rewrite --page-size`)")
    engine.add_argument("--num-blocks", type=int, default=None, help="KV blocks per pool group (pool size)")
    engine.add_argument("--host-blocks", type=int, default=0, help="pinned host blocks per group (--preemption swap)")
    engine.add_argument("--chunk-size", type=int, default=512, help="prefill tokens of a prompt per step")
    engine.add_argument("--max-num-seqs", type=int, default=max_num_seqs, help="sequences in flight at once")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step")
    engine.add_argument("--max-model-len", type=int, default=None, help="context limit (prompt + output)")
    engine.add_argument("--preemption", choices=PREEMPTION_MODES, default="recompute",
                        help="when the KV pool runs out: recompute a preempted sequence, or swap its blocks to host")
    engine.add_argument("--no-prefix-reuse", action="store_true", help="do not share cached prompt prefixes")


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    prompts = parser.add_argument_group("prompts")
    prompts.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    prompts.add_argument("--input-ids-file", default=None,
                         help='token ids, JSON lines {"id": ..., "input_ids": [...]} (no tokenizer needed)')
    prompts.add_argument("--chat", action="store_true", help="send each --prompt as a user message of a chat")
    sampling = parser.add_argument_group("sampling (default: greedy)")
    sampling.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="tokens per prompt")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    sampling.add_argument("--top-k", type=int, default=0, help="0: off")
    sampling.add_argument("--top-p", type=float, default=1.0, help="1: off")
    sampling.add_argument("--min-p", type=float, default=0.0, help="0: off")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0, help="1: off")
    sampling.add_argument("--presence-penalty", type=float, default=0.0, help="0: off")
    sampling.add_argument("--frequency-penalty", type=float, default=0.0, help="0: off")
    sampling.add_argument("--seed", type=int, default=None, help="per-request seeds derive from it (default 0)")
    sampling.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    sampling.add_argument("--stop-token-ids", default=None, help="comma-separated token ids that end the output")
    sampling.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS tokens")
    sampling.add_argument("--logprobs", type=int, default=None, help="report N top logprobs per token (--jsonl)")
    add_engine_arguments(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--jsonl", action="store_true", help="JSON lines {id, output_ids, text, finish_reason}")
    out.add_argument("-o", "--output", default=None, help="write the JSON lines to this file")


def read_input_ids(path) -> list[tuple[object, list[int]]]:
    """(id, token ids) of each line of a JSON-lines file ``{"id": ..., "input_ids": [...]}``."""
    return [(rid, prompt) for rid, prompt, _ in read_prompt_lines(path, "--input-ids-file")]


def read_prompt_lines(path, name: str, *, text: bool = False) -> list[tuple[object, object, dict]]:
    """(id, prompt, the line's object) of each line of a JSON-lines file: ``{"id": ..., "input_ids": [...]}``
    or, with ``text``, ``{"id": ..., "prompt": "..."}`` too; ids default to the line number and are unique."""
    src = check_input_file(path, name)
    out, seen = [], set()
    shape = '{"id": ..., "input_ids": [...]}' + (' or {"id": ..., "prompt": "..."}' if text else "")
    for n, line in enumerate(src.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name} {src}:{n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not ("input_ids" in record or text and "prompt" in record):
            raise UsageError(f"{where}: expected an object {shape}")
        if "input_ids" in record:
            prompt = record["input_ids"]
            if not isinstance(prompt, list) or not prompt or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
                raise UsageError(f"{where}: input_ids must be a non-empty list of token ids >= 0")
        else:
            prompt = record["prompt"]
            if not isinstance(prompt, str) or not prompt:
                raise UsageError(f"{where}: prompt must be a non-empty string")
        rid = record.get("id", n)
        if not isinstance(rid, (str, int)) or isinstance(rid, bool) or rid in seen:
            raise UsageError(f"{where}: id must be a string or an integer, unique in the file; got {rid!r}")
        seen.add(rid)
        out.append((rid, prompt, record))
    if not out:
        raise UsageError(f"{name} {src}: no prompts in it")
    return out


def _params(args):
    from pagedkv.runtime.sampling import SamplingParams

    stop_ids = parse_int_list("--stop-token-ids", args.stop_token_ids, low=0) if args.stop_token_ids else ()
    try:
        return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                              seed=args.seed, logprobs=args.logprobs, stop=tuple(args.stop),
                              stop_token_ids=tuple(stop_ids), ignore_eos=args.ignore_eos)
    except ValueError as exc:
        raise option_error(exc) from None


def open_llm(args, *, seed: int = 0):
    """The ``LLM`` of ``add_model_arguments`` + ``add_engine_arguments``; bad values are ``UsageError``s."""
    from pagedkv.runtime.api import LLM, is_engine_file
    from pagedkv.runtime.backends import BackendUnavailable
    from pagedkv.runtime.graph import GraphError
    from pagedkv.runtime.tokenizer import TokenizerError

    model = check_input_file(args.model, "model")
    if model.suffix.lower() != ".onnx" and not is_engine_file(model):
        raise UsageError(f"model: {str(model)!r} is neither a rewritten .onnx nor an engine (.engine, .plan, .trt)")
    graph = model if args.graph is None and not is_engine_file(model) else args.graph
    if graph is not None:  # its structure, without the weights: a file that is no ONNX model is said here
        from pagedkv import onnx_io

        onnx_io.load(graph, "model" if graph is model else "--graph")
    if args.tokenizer is not None:
        check_input_dir(args.tokenizer, "--tokenizer")
    lowest = {"chunk_size": 0, "max_num_seqs": 1, "max_num_batched_tokens": 1, "num_blocks": 1, "host_blocks": 0,
              "max_model_len": 1}
    for name, low in lowest.items():
        if getattr(args, name) is not None:
            check_int(f"--{name.replace('_', '-')}", getattr(args, name), low=low)
    if args.page_size is not None:
        from pagedkv.config import ATTRIBUTE_RANGES

        low, high = ATTRIBUTE_RANGES["page_size"]
        check_int("--page-size", args.page_size, low=low, high=high)
    try:
        llm = LLM(str(model), tokenizer=args.tokenizer, backend=args.backend, graph=args.graph,
                  num_blocks=args.num_blocks, host_blocks=args.host_blocks, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, chunk_size=args.chunk_size,
                  preemption=args.preemption, max_model_len=args.max_model_len,
                  enable_prefix_reuse=not args.no_prefix_reuse, seed=seed)
    except (GraphError, TokenizerError, BackendUnavailable) as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:
        raise option_error(exc) from None
    sizes = {g.page_size for g in llm.executor.graph.groups}
    if args.page_size is not None and sizes != {args.page_size}:
        llm.close()
        raise UsageError(f"--page-size: the graph's KV pages hold {sorted(sizes)} tokens, not {args.page_size} "
                         "(the page size is fixed by `pagedkv rewrite --page-size`)")
    return llm


def run_generate(args) -> int:
    from pagedkv.runtime.request import ContextLengthError

    if bool(args.prompt) == bool(args.input_ids_file):
        raise UsageError("prompts: give --prompt TEXT (repeatable) or --input-ids-file F.jsonl, one of the two")
    if args.output and not args.jsonl:
        raise UsageError("-o/--output: writes JSON lines; add --jsonl")
    if args.chat and not args.prompt:
        raise UsageError("--chat: applies to --prompt texts")
    params = _params(args)
    records = read_input_ids(args.input_ids_file) if args.input_ids_file else None
    out_path = Path(args.output) if args.output else None
    with open_llm(args, seed=args.seed or 0) as llm:
        if records is not None:
            ids, prompts = [r[0] for r in records], [r[1] for r in records]
        else:
            if llm.tokenizer is None:
                raise UsageError(f"--prompt: text needs a tokenizer; none in {str(Path(args.model).parent)!r} "
                                 "(give --tokenizer DIR, or --input-ids-file with token ids)")
            ids = list(range(len(args.prompt)))
            prompts = [{"messages": [{"role": "user", "content": p}]} if args.chat else p for p in args.prompt]
        try:
            if args.jsonl:
                lines = [_json_line(c) for c in llm.generate(prompts, params, ids=ids, quiet=args.quiet)]
                _write_lines(lines, out_path, [args.model, args.input_ids_file])
            else:
                _print_text(llm, ids, prompts, params)
        except ContextLengthError as exc:
            raise UsageError(str(exc)) from None
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return 0


def _json_line(c) -> str:
    record = {"id": c.id, "output_ids": c.output_ids, "text": c.text, "finish_reason": c.finish_reason}
    if c.logprobs:
        record["logprobs"] = [{"token": lp.token, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                              for lp in c.logprobs]
    return json.dumps(record)


def _write_lines(lines, path, inputs) -> None:
    if path is None:
        sys.stdout.write("".join(line + "\n" for line in lines))
        return
    with atomic_output(path, inputs=[p for p in inputs if p]) as tmp:
        tmp.write_text("".join(line + "\n" for line in lines))


def _print_text(llm, ids, prompts, params) -> None:
    """One prompt: its text (token ids without a tokenizer) as it is generated; several: each completion when
    it is done, tagged with its id."""
    def show(tokens, text) -> str:
        return text if llm.tokenizer is not None else "".join(f"{t} " for t in tokens)

    if len(prompts) == 1:
        for delta in llm.stream(prompts, params, ids=ids):
            sys.stdout.write(show(delta.token_ids, delta.text))
            sys.stdout.flush()
            if delta.finished:
                sys.stdout.write(f"\n[{delta.finish_reason}]\n")
        return
    parts: dict = {}
    for delta in llm.stream(prompts, params, ids=ids):
        tokens, text = parts.setdefault(delta.id, ([], []))
        tokens += delta.token_ids
        text.append(delta.text)
        if delta.finished:
            sys.stdout.write(f"[{delta.id}] {show(tokens, ''.join(text))} [{delta.finish_reason}]\n")
            sys.stdout.flush()
