"""The fixed schedule ``compare`` drives both graphs with: prompts go through (chunked) prefill and then a fixed
number of decode steps, every prompt in every step until it is done (serving is ``pagedkv.runtime.scheduler``:
requests join and leave, token budgets, preemption).

Every step takes, for each unfinished request in arrival order, either its next prompt chunk (up to
``chunk_size`` tokens; 0 = the whole remaining prompt) or, once its prompt is in, one decode token — so
steps mix prefill chunks and decode tokens whenever prompt lengths differ. The token that follows a
request's last prompt token / its previous decode token comes from ``choose_next`` (greedy argmax of the
logits the caller trusts), so that two sessions driven by the same ``Schedule`` see identical inputs.

    sched = Schedule([Prompt("a", prompt_a), Prompt("b", prompt_b)], decode_steps=8, chunk_size=16)
    while (entries := sched.next_step()):
        logits = session.step(entries)
        sched.advance([int(np.argmax(lg[-1])) for lg in logits])
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Prompt:
    id: object
    prompt: np.ndarray
    fed: int = 0  # prompt tokens already sent
    generated: list = field(default_factory=list)  # tokens chosen after the prompt (each fed once decoded)
    decoded: int = 0  # decode tokens already sent

    def __post_init__(self):
        self.prompt = np.asarray(self.prompt, dtype=np.int64).ravel()
        if self.prompt.size == 0:
            raise ValueError(f"request {self.id!r}: the prompt is empty")


class Schedule:
    def __init__(self, requests, *, decode_steps: int, chunk_size: int = 0):
        if decode_steps < 0:
            raise ValueError(f"decode_steps: must be >= 0, got {decode_steps}")
        if chunk_size < 0:
            raise ValueError(f"chunk_size: must be >= 0 (0: whole prompt), got {chunk_size}")
        self.requests = list(requests)
        ids = [r.id for r in self.requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"requests: ids must be unique, got {ids}")
        self.decode_steps = int(decode_steps)
        self.chunk_size = int(chunk_size)
        self._pending: list[Prompt] = []
        self.steps = 0

    def _active(self, r: Prompt) -> bool:
        return r.fed < r.prompt.size or r.decoded < self.decode_steps

    def next_step(self) -> list[tuple[object, np.ndarray]]:
        """The next step's entries ``[(request id, new token ids)]``; empty when all requests are done."""
        if self._pending:
            raise RuntimeError("next_step: advance() the previous step first")
        entries = []
        for r in self.requests:
            if r.fed < r.prompt.size:
                n = r.prompt.size - r.fed if not self.chunk_size else min(self.chunk_size, r.prompt.size - r.fed)
                entries.append((r.id, r.prompt[r.fed:r.fed + n]))
                r.fed += n
            elif r.decoded < self.decode_steps:
                entries.append((r.id, np.asarray([r.generated[-1]], dtype=np.int64)))
                r.decoded += 1
            else:
                continue
            self._pending.append(r)
        if entries:
            self.steps += 1
        return entries

    @property
    def pending(self) -> list[Prompt]:
        """The requests of the current step, in entry order."""
        return list(self._pending)

    def wants_next_token(self, index: int) -> bool:
        """Whether entry ``index`` of the current step ends at a point where a next token is chosen."""
        r = self._pending[index]
        return r.fed == r.prompt.size and len(r.generated) < self.decode_steps

    def advance(self, next_tokens) -> None:
        """``next_tokens[i]``: the token after entry i's last token (ignored where not wanted: None ok)."""
        if len(next_tokens) != len(self._pending):
            raise ValueError(f"advance: {len(next_tokens)} tokens for {len(self._pending)} entries")
        for i, tok in enumerate(next_tokens):
            if self.wants_next_token(i):
                if tok is None:
                    raise ValueError(f"advance: request {self._pending[i].id!r} needs its next token")
                self._pending[i].generated.append(int(tok))
        self._pending = []

    def finished(self) -> list:
        """Prompts that sent everything (their sequences can be freed)."""
        return [r.id for r in self.requests if not self._active(r)]


def generate_greedy(session, prompts, *, max_new_tokens: int, chunk_size: int = 0) -> list[list[int]]:
    """Greedy tokens from any session with ``step(entries)`` (an executor or ``DenseSession``), argmax of the
    logits on the host: one list per prompt."""
    requests = [Prompt(i, p) for i, p in enumerate(prompts)]
    sched = Schedule(requests, decode_steps=max_new_tokens, chunk_size=chunk_size)
    freed = set()
    while entries := sched.next_step():
        logits = session.step(entries)
        sched.advance([int(np.argmax(lg[-1])) for lg in logits])
        for rid in sched.finished():
            if rid not in freed and session.has_sequence(rid):
                session.free(rid)
                freed.add(rid)
    # the last chosen token is never fed back, so max_new_tokens decode steps yield max_new_tokens tokens
    return [list(r.generated) for r in requests]
