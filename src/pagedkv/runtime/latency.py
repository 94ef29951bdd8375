"""When a request's tokens arrived, as its consumer saw them: time to first token, inter-token latency, end to end.

``pagedkv serve`` feeds its Prometheus histograms from it and ``pagedkv bench`` its percentiles, so both
measure the same thing the same way: the clock starts when the request is submitted, and each delta that
carries tokens is one arrival (a step gives a request one token, so a delta is normally one token).

    timing = RequestTiming()                    # at submit
    for delta in handle:
        gap = timing.arrived(len(delta.token_ids))   # None for the first tokens (that is the TTFT)
    timing.finish()
    timing.ttft, timing.gaps, timing.e2e, timing.tokens
"""

from __future__ import annotations

import time


class RequestTiming:
    """One request's arrival times (seconds, ``time.perf_counter``); see the module docstring."""

    __slots__ = ("start", "first", "last", "end", "tokens", "gaps")

    def __init__(self, start: float | None = None):
        self.start = time.perf_counter() if start is None else start
        self.first: float | None = None  # first tokens
        self.last: float | None = None  # latest tokens
        self.end: float | None = None
        self.tokens = 0
        self.gaps: list[float] = []  # between successive arrivals, one per token after the first arrival

    def arrived(self, num_tokens: int, now: float | None = None) -> float | None:
        """Record ``num_tokens`` arriving now; returns the gap per token since the previous arrival (None for
        the first, and for arrivals without tokens)."""
        if num_tokens <= 0:
            return None
        now = time.perf_counter() if now is None else now
        gap = None
        if self.first is None:
            self.first = now
        else:
            gap = (now - self.last) / num_tokens
            self.gaps.extend([gap] * num_tokens)
        self.last = now
        self.tokens += num_tokens
        return gap

    def finish(self, now: float | None = None) -> float:
        """The request ended; returns its end-to-end latency."""
        self.end = time.perf_counter() if now is None else now
        return self.end - self.start

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start
