"""Iteration-level continuous batching: which requests run in the next step, and with how many tokens.

Every step (``Scheduler.schedule``), within ``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens:

1. **Decodes first**: every running request whose known tokens are all in the cache takes one token. Their
   KV slots are reserved together (``KVCacheManager.reserve_many``); when the pool is short, the newest
   running request is preempted and the reservation retried, until it fits.
2. **Prefill chunks** of running requests still in prefill, oldest first: up to ``chunk_size`` tokens each,
   within the token budget left. A chunk that does not fit preempts newer running requests; with none newer,
   prefills wait for a later step.
3. **Swapped-out** requests come back (``swap_in``) when their blocks fit, oldest first, as decodes or
   chunks of the next steps.
4. **Waiting** requests join, first come first served (never skipping one that does not fit): the KV manager
   adopts the longest cached prefix of their tokens (prefix reuse: those tokens skip their prefill) and their
   first chunk is reserved; a request is only admitted while ``watermark`` of the pool stays free after it.

Priority is arrival order throughout: a request is only ever preempted in favour of an older one, so the
oldest request always progresses (it fits the pool alone: ``Engine.add_request`` refuses requests that could
not), and nothing deadlocks. **Preemption** (``preemption``): ``"recompute"`` frees the request's blocks (full
pages stay in the prefix cache until evicted, so its prefill may find them again) and it waits at the front of
the queue to be prefilled again, prompt and output; ``"swap"`` moves its blocks to the pinned host tier
(``host_blocks``) and back later — a swap that does not fit the host tier falls back to recompute.
Abort (``Engine.abort``) frees a request's blocks at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedkv.kvcache.errors import KVCacheExhaustedError
from pagedkv.runtime.request import Request, RequestState

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences per step
    max_num_batched_tokens: int = 2048  # tokens per step (decodes count one each)
    chunk_size: int = 512  # prefill tokens of one request per step (0: as many as the budget allows)
    preemption: str = "recompute"
    watermark: float = 0.01  # fraction of each pool kept free when admitting a new request

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} < max_num_seqs="
                             f"{self.max_num_seqs}: a step of decodes alone would not fit the budget")
        if self.chunk_size < 0:
            raise ValueError(f"chunk_size: must be >= 0 (0: the token budget), got {self.chunk_size}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption: expected one of {PREEMPTION_MODES}, got {self.preemption!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark: expected a fraction in [0, 1), got {self.watermark}")


@dataclass
class ScheduledStep:
    """A step: ``decodes`` (one token each) then ``prefills`` (request, tokens), in the step's token order.
    ``decode_ids``: the decodes' request ids as reserved (the engine's batched KV calls take them; None once one
    of the decodes was preempted)."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    decode_ids: tuple | None = None

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)


@dataclass
class SchedulerStats:
    steps: int = 0
    prefill_steps: int = 0  # steps with a prefill chunk
    mixed_steps: int = 0  # steps with prefill chunks and decodes together
    preemptions: int = 0  # by recompute
    swaps_out: int = 0
    swaps_in: int = 0
    prefix_tokens_reused: int = 0


class Scheduler:
    """Holds the request queues; ``schedule()`` reserves the next step's KV in ``manager`` (module docstring)."""

    def __init__(self, manager, config: SchedulerConfig):
        self.manager = manager
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # arrival order
        self.swapped: deque[Request] = deque()
        self.stats = SchedulerStats()
        self._preempted_now: set[int] = set()
        self._min_free = [int(config.watermark * nb) for nb in manager.num_blocks]

    # ---- queues ----------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.state = RequestState.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it and free its blocks (abort, finish)."""
        if request.state == RequestState.WAITING:
            self.waiting.remove(request)
        elif request.state == RequestState.RUNNING:
            self.running.remove(request)
            self.manager.free(request.id)
        elif request.state == RequestState.SWAPPED:
            self.swapped.remove(request)
            self.manager.free(request.id)

    def finish_many(self, requests: list[Request]) -> None:
        """Finished running requests leave: blocks freed, running list rebuilt once."""
        gone = set(map(id, requests))
        for r in requests:
            self.manager.free(r.id)
        self.running = [r for r in self.running if id(r) not in gone]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- preemption ------------------------------------------------------------------------------------
    def _preempt(self, victim: Request, step: ScheduledStep) -> None:
        """Take ``victim`` (running) out of this step and out of the pool: swap or recompute."""
        mgr = self.manager
        if victim in step.decodes:
            step.decodes.remove(victim)
            step.decode_ids = None
        step.prefills = [(r, n) for r, n in step.prefills if r is not victim]
        if mgr.reserved(victim.id):
            mgr.unreserve(victim.id)
        self.running.remove(victim)
        victim.num_preemptions += 1
        self._preempted_now.add(id(victim))
        if self.config.preemption == "swap":
            try:
                mgr.swap_out(victim.id)
            except KVCacheExhaustedError:  # the host tier is full: recompute instead
                pass
            else:
                victim.state = RequestState.SWAPPED
                self.swapped.append(victim)
                self.swapped = deque(sorted(self.swapped, key=lambda r: r.arrival))
                self.stats.swaps_out += 1
                return
        mgr.free(victim.id)
        victim.num_computed = 0
        victim.state = RequestState.WAITING
        self.waiting.appendleft(victim)  # older than anything waiting: it was admitted first
        self.stats.preemptions += 1

    # ---- the step --------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        cfg, mgr = self.config, self.manager
        step = ScheduledStep()
        self._preempted_now: set[int] = set()  # not resumed in the step that preempted them
        # A running request decodes when all its known tokens but the last are in the cache; in a steady state of
        # decodes (nothing else running) one pass finds that out
        others = [r for r in self.running if r.num_computed != r.num_tokens - 1]
        step.decodes = ([r for r in self.running if r.num_computed == r.num_tokens - 1] if others
                        else list(self.running))
        while step.decodes:
            ids = tuple([r.id for r in step.decodes])
            try:
                mgr.reserve_many(ids, 1)
                step.decode_ids = ids
                break
            except KVCacheExhaustedError:
                self._preempt(self.running[-1], step)
        for r in [r for r in others if r.num_computed < r.num_tokens - 1]:  # (those still in prefill)
            if r.state != RequestState.RUNNING:  # preempted meanwhile: for the decodes or an older request's chunk
                continue
            budget = cfg.max_num_batched_tokens - step.num_tokens
            if budget <= 0 or len(step.decodes) + len(step.prefills) >= cfg.max_num_seqs:
                break
            n = self._chunk(r, budget)
            while not self._try_reserve(r, n):
                newer = [v for v in self.running if v.arrival > r.arrival]
                if not newer:
                    n = 0
                    break
                self._preempt(newer[-1], step)
            if not n:
                break
            step.prefills.append((r, n))
        budget = cfg.max_num_batched_tokens - step.num_tokens
        seqs = len(step.decodes) + len(step.prefills)
        while self.swapped and budget > 0 and seqs < cfg.max_num_seqs and len(self.running) < cfg.max_num_seqs:
            r = self.swapped[0]
            if id(r) in self._preempted_now:
                break
            try:
                mgr.swap_in(r.id)
            except KVCacheExhaustedError:
                break
            self.swapped.popleft()
            r.state = RequestState.RUNNING
            self._insert_running(r)
            self.stats.swaps_in += 1
        while self.waiting and budget > 0 and seqs < cfg.max_num_seqs and len(self.running) < cfg.max_num_seqs:
            r = self.waiting[0]
            if id(r) in self._preempted_now:
                break
            reused = mgr.add_sequence(r.id, prompt_tokens=r.tokens())
            n = self._chunk(r, budget, computed=reused)
            if not self._try_reserve(r, n, admit=True):
                mgr.free(r.id)
                break
            self.waiting.popleft()
            r.num_computed = reused
            self.stats.prefix_tokens_reused += reused
            r.state = RequestState.RUNNING
            self._insert_running(r)
            step.prefills.append((r, n))
            budget -= n
            seqs += 1
        if step:
            self.stats.steps += 1
            self.stats.prefill_steps += bool(step.prefills)
            self.stats.mixed_steps += bool(step.prefills and step.decodes)
        return step

    def _chunk(self, r: Request, budget: int, computed: int | None = None) -> int:
        left = r.num_tokens - (r.num_computed if computed is None else computed)
        n = min(left, budget)
        return min(n, self.config.chunk_size) if self.config.chunk_size else n

    def _try_reserve(self, r: Request, n: int, admit: bool = False) -> bool:
        mgr = self.manager
        try:
            mgr.reserve(r.id, n)
        except KVCacheExhaustedError:
            return False
        if admit and any(mgr.num_free(g) < m for g, m in enumerate(self._min_free)) and self.running:
            mgr.unreserve(r.id)
            return False
        return True

    def _insert_running(self, r: Request) -> None:
        """Keep ``running`` in arrival order (a resumed request is older than later admissions)."""
        i = len(self.running)
        while i and self.running[i - 1].arrival > r.arrival:
            i -= 1
        self.running.insert(i, r)
