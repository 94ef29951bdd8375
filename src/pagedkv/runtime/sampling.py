"""Sampling on the host side: the per-request parameters, seeded uniforms, penalty bookkeeping, and the rows
of the sampling head's inputs (``pagedkv.engine_io``: ``sampling_params``, ``penalty_tokens``, ``penalty_counts``).

The choice itself happens in the graph (``pagedkv.builder.logits_head``; its float64 spec is
``pagedkv.reference.sampling``): the host only sends each row's parameters and one uniform draw u. The draws
come from a counter-based generator: u of a request's k-th generated token is the k-th output of SplitMix64
seeded with the request's seed (``uniforms``), so a request's tokens depend on its seed alone — not on what it
was batched with, not on preemption and recompute — and all rows of a step are drawn in one numpy expression.

``host_sample`` runs the same spec on logits brought to the host, for graphs rewritten without the sampling
head (``pagedkv rewrite --no-sampling``): the slow path, a full-vocabulary copy per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pagedkv import engine_io as io

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_SHIFTS = tuple(np.uint64(k) for k in (30, 27, 31, 11))  # (made once: a step draws every row's uniform)
U_MAX = float(np.nextafter(np.float32(1), np.float32(0)))  # largest float32 below 1: u stays in [0, 1)


def splitmix64(state: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of ``state`` (uint64 array): the mix of ``state + golden``."""
    s30, s27, s31, _ = _SHIFTS
    with np.errstate(over="ignore"):  # (uint64 arithmetic wraps, as SplitMix64's does)
        z = np.asarray(state, dtype=np.uint64) + _GOLDEN  # a new array: the steps below work in place
        z ^= z >> s30
        z *= _MIX1
        z ^= z >> s27
        z *= _MIX2
        z ^= z >> s31
    return z


def uniforms(seeds, counters) -> np.ndarray:
    """float64 [R] in [0, 1): draw number ``counters[r]`` (0, 1, ...) of the SplitMix64 stream seeded
    ``seeds[r]`` — the generator's state after k draws is ``seed + k * golden``, so draw k needs no state."""
    with np.errstate(over="ignore"):
        state = np.asarray(seeds, dtype=np.uint64) + np.asarray(counters, dtype=np.uint64) * _GOLDEN
    u = (splitmix64(state) >> _SHIFTS[3]).astype(np.float64)
    u *= 2.0 ** -53
    return u


def derive_seed(base: int, index: int) -> int:
    """A request's seed when it gives none: the mix of the stream seeded ``base`` (the engine's seed) at
    ``index`` (its arrival number)."""
    return int(splitmix64(np.asarray([base], np.uint64) + np.asarray([index], np.uint64) * _GOLDEN)[0])


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. Defaults: greedy, 16 new tokens, stop at the model's EOS.

    max_new_tokens: None = up to the context limit. temperature <= 0 is greedy (argmax). top_k 0, top_p 1 and
    min_p 0 are off. repetition_penalty divides positive / multiplies negative logits of every prompt and output
    token (1: off); presence_penalty and frequency_penalty subtract from output tokens' logits (OpenAI's).
    seed: the request's random stream (None: derived from the engine's seed). logprobs: None reports none, 0
    the chosen token's logprob, n also the n most likely tokens (up to the graph's ``top_logprobs``). stop: strings that end the output
    (it is cut before them unless include_stop_str_in_output); stop_token_ids end it too (the token kept);
    ignore_eos: do not stop at the model's EOS tokens.
    """

    max_new_tokens: int | None = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, (str, int)):
                value = (value,)
            object.__setattr__(self, name, tuple(value))
        if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, (int, np.integer))
                                                or self.max_new_tokens < 1):
            raise ValueError(f"max_new_tokens: expected an integer >= 1 or None, got {self.max_new_tokens!r}")
        checks = (("temperature", 0.0, None), ("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0),
                  ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0))
        for name, low, high in checks:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < low or (high is not None and v > high):
                bound = f"in [{low:g}, {high:g}]" if high is not None else f">= {low:g}"
                raise ValueError(f"{name}: expected a finite number {bound}, got {v!r}")
        if self.top_p == 0.0:
            raise ValueError("top_p: must be > 0 (1 turns it off), got 0")
        if not (isinstance(self.repetition_penalty, (int, float)) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty: expected a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("top_k", "logprobs"):
            v = getattr(self, name)
            if (v is not None or name == "top_k") and (not isinstance(v, (int, np.integer)) or v < 0):
                raise ValueError(f"{name}: expected an integer >= 0, got {v!r}")
        if self.seed is not None and (not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 2 ** 64):
            raise ValueError(f"seed: expected an integer in [0, 2**64), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop: expected non-empty strings, got {list(self.stop)}")
        if any(not isinstance(t, (int, np.integer)) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: expected token ids >= 0, got {list(self.stop_token_ids)}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def row(self) -> np.ndarray:
        """float32 [SAMPLING_FIELDS]: this request's ``sampling_params`` row (the uniform column left 0)."""
        r = np.zeros(io.SAMPLING_FIELDS, dtype=np.float32)
        r[io.SAMPLING_TEMPERATURE] = self.temperature
        r[io.SAMPLING_TOP_K] = self.top_k
        r[io.SAMPLING_TOP_P] = self.top_p
        r[io.SAMPLING_MIN_P] = self.min_p
        r[io.SAMPLING_REPETITION] = self.repetition_penalty
        r[io.SAMPLING_PRESENCE] = self.presence_penalty
        r[io.SAMPLING_FREQUENCY] = self.frequency_penalty
        return r


@dataclass
class Penalties:
    """The distinct tokens a penalized request's penalties apply to (prompt and output) and their output counts."""

    index: dict[int, int] = field(default_factory=dict)  # token -> position in tokens / counts
    tokens: list[int] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)

    @classmethod
    def of_prompt(cls, prompt) -> "Penalties":
        p = cls()
        for t in dict.fromkeys(np.asarray(prompt).tolist()):
            p.index[t] = len(p.tokens)
            p.tokens.append(t)
            p.counts.append(0.0)
        return p

    def add_output(self, token: int) -> None:
        i = self.index.get(token)
        if i is None:
            self.index[token] = len(self.tokens)
            self.tokens.append(token)
            self.counts.append(1.0)
        else:
            self.counts[i] += 1.0


def sampling_inputs(rows: np.ndarray, seeds: np.ndarray, counters: np.ndarray, penalties: list | None):
    """The sampling head's inputs for R rows: ``rows`` float32 [R, F] (each request's ``SamplingParams.row``),
    their ``seeds`` / draw ``counters`` (uint64 [R]), and per row a ``Penalties`` or None (``penalties`` None:
    no row has any)."""
    from pagedkv.runtime.executor import SamplingInputs

    params = np.array(rows, dtype=np.float32, copy=True)
    params[:, io.SAMPLING_UNIFORM] = np.minimum(uniforms(seeds, counters), U_MAX)
    if penalties is None:
        return SamplingInputs(params, np.full((len(params), 1), -1, np.int32), np.zeros((len(params), 1), np.float32))
    width = max([len(p.tokens) for p in penalties if p is not None] + [1])
    tokens = np.full((len(penalties), width), -1, dtype=np.int32)
    counts = np.zeros((len(penalties), width), dtype=np.float32)
    for r, p in enumerate(penalties):
        if p is not None and p.tokens:
            tokens[r, :len(p.tokens)] = p.tokens
            counts[r, :len(p.counts)] = p.counts
    return SamplingInputs(params, tokens, counts)


def host_sample(logits: np.ndarray, inputs, *, top_logprobs: int):
    """The sampling head's outputs computed on the host from logits [R, V] (graphs without the head), in the
    head's dtypes: (next_tokens int32, next_logprobs float32, top_tokens int32 [R, N], top_logprobs float32)."""
    from pagedkv.reference.sampling import sampling_head

    tokens, lp, top, top_lp = sampling_head(logits, inputs.params, inputs.penalty_tokens, inputs.penalty_counts,
                                            candidates=logits.shape[1], top_logprobs=top_logprobs)
    return tokens.astype(np.int32), lp.astype(np.float32), top.astype(np.int32), top_lp.astype(np.float32)
