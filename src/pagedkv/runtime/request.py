"""One generation request: its tokens, where it stands in the KV cache, and how it ends.

A request's known tokens are its prompt followed by its output. ``num_computed`` of them have their KV in the
cache (the KV manager's committed length while it runs); the next step feeds the tokens from there on — a
prefill chunk, or the last output token as a decode — and, when that reaches the last known token, the step's
logits row for it picks the next token. Preempted by recompute, a request loses its KV (``num_computed`` back
to what the prefix cache still holds) and its output is prefilled again with the prompt; preempted by swap,
its blocks wait in the host tier.

States: WAITING (not in the KV manager) -> RUNNING <-> SWAPPED, -> FINISHED (reason: "stop" at an EOS / stop
token / stop string, "length" at max_new_tokens, "abort", "error"). A request is never in two states.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from pagedkv.runtime.sampling import Penalties, SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class ContextLengthError(ValueError):
    """A request that can never fit: prompt + max_new_tokens beyond the context limit or the KV pool."""


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's logprob and the ``SamplingParams.logprobs`` best alternatives (token, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Request:
    """A request inside the engine (fields are the engine's; read them, do not write them)."""

    __slots__ = ("id", "prompt", "params", "arrival", "seed", "max_tokens", "stop_ids", "output", "logprobs",
                 "num_computed", "num_tokens", "state", "finish_reason", "error", "penalties", "row", "text",
                 "detokenizer", "extras", "num_preemptions")

    def __init__(self, request_id, prompt, params: SamplingParams, *, arrival: int, seed: int, max_tokens: int,
                 stop_ids: frozenset):
        self.id = request_id
        # an array, not a list of ints: long prompts would make every garbage collection walk their tokens
        self.prompt = np.array(prompt, dtype=np.int64)
        self.prompt.flags.writeable = False
        self.params = params
        self.arrival = arrival  # order of submission: the scheduler's priority (earlier first)
        self.seed = seed
        self.max_tokens = max_tokens  # new tokens at most
        self.stop_ids = stop_ids  # EOS (unless ignore_eos) and stop_token_ids
        self.output: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.num_computed = 0
        self.num_tokens = len(self.prompt)  # prompt + output (kept by the engine as it appends)
        self.state = RequestState.WAITING
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.penalties = Penalties.of_prompt(self.prompt) if params.penalized else None
        self.row = params.row()  # its sampling_params row
        self.text = ""  # detokenized output (with a tokenizer)
        self.detokenizer = None  # the engine's TextStream, with a tokenizer
        self.extras = self.penalties is not None or params.logprobs is not None  # per-token work beyond appending
        self.num_preemptions = 0

    @property
    def finished(self) -> bool:
        return self.state == RequestState.FINISHED

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]:
        """Known tokens [start, end) of prompt then output (all by default)."""
        n = len(self.prompt)
        end = self.num_tokens if end is None else end
        if start >= n:
            return self.output[start - n:end - n]
        if end <= n:
            return self.prompt[start:end].tolist()
        return self.prompt[start:].tolist() + self.output[:end - n]

    def __repr__(self) -> str:
        return (f"Request({self.id!r}, {self.state.value}, prompt {len(self.prompt)}, output {len(self.output)}, "
                f"computed {self.num_computed})")
