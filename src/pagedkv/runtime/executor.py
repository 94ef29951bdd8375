"""Executors: one interface over every way a rewritten graph runs, step by step, over the KV manager's pools.

    executor.execute(StepInputs(batch, input_ids, logits_rows, sampling)) -> StepOutputs

An executor owns its ``manager`` (``pagedkv.kvcache.KVCacheManager``, pools in the storage its backend needs)
and its ``graph`` (``RewrittenGraph``: pool groups, engine I/O). The caller — the scheduler's engine
(``pagedkv.runtime.engine``), or ``step()`` below for ``compare`` — does the KV bookkeeping (add, reserve,
``build_step``, commit); the executor binds the step as the engine inputs of ``pagedkv.engine_io`` by name,
runs it, checks every ``kv_write_status_{i}`` (``KVWriteError``) and returns what was asked for: the next
tokens and logprobs from the graph's sampling head (a few numbers per row: no full-vocabulary copy to the
host) and/or the logits of the ``logits_rows`` rows.

| executor | where | module |
| --- | --- | --- |
| ``OrtExecutor(model, backend="reference")`` | ONNX Runtime (CPU), plugin ops = float64 references on numpy pools | ``session.py`` |
| ``OrtExecutor(model, backend="cuda")`` | ONNX Runtime, plugin ops = the CUDA kernels on device pools | ``session.py`` |
| ``TrtExecutor(rewritten, engine=...)`` | a TensorRT engine, one stream, CUDA graphs for repeated decode shapes | ``trt.py`` |

Subclasses implement ``_run(feed, output_names) -> {name: host array}``; everything else is shared.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from pagedkv import engine_io
from pagedkv.step import raise_for_status

StepEntries = list  # [(seq_id, np.ndarray of new token ids)]


@dataclass
class SamplingInputs:
    """The sampling head's inputs for R logits rows (``pagedkv.engine_io``)."""

    params: np.ndarray  # float32 [R, SAMPLING_FIELDS]
    penalty_tokens: np.ndarray  # int32 [R, W], -1 padded
    penalty_counts: np.ndarray  # float32 [R, W]

    @classmethod
    def greedy(cls, rows: int) -> "SamplingInputs":
        """Greedy rows without penalties (what a step that only wants logits feeds a sampling graph)."""
        params = np.zeros((rows, engine_io.SAMPLING_FIELDS), dtype=np.float32)
        params[:, engine_io.SAMPLING_TOP_P] = 1.0
        params[:, engine_io.SAMPLING_REPETITION] = 1.0
        return cls(params, np.full((rows, 1), -1, dtype=np.int32), np.zeros((rows, 1), dtype=np.float32))


@dataclass
class StepInputs:
    """One step: the KV manager's ``StepBatch``, the packed tokens and the rows whose next token is wanted."""

    batch: object  # pagedkv.kvcache.StepBatch
    input_ids: np.ndarray  # int64 [T], sequence after sequence
    logits_rows: np.ndarray  # int32 [R], indices into input_ids
    sampling: SamplingInputs | None = None  # None: greedy, logits wanted
    want_logits: bool = False


@dataclass
class StepOutputs:
    logits: np.ndarray | None = None  # float32 [R, vocab], when asked for (or the graph has no sampling head)
    next_tokens: np.ndarray | None = None  # int32 [R]
    next_logprobs: np.ndarray | None = None  # float32 [R]
    top_tokens: np.ndarray | None = None  # int32 [R, N]
    top_logprobs: np.ndarray | None = None  # float32 [R, N]


class _PadSequence:
    def __repr__(self) -> str:
        return "<pad>"


PAD_SEQUENCE = _PadSequence()  # the KV manager sequence whose blocks padding rows write into


def last_token_rows(cu_q_lens: np.ndarray) -> np.ndarray:
    """int32 [B]: the index of each sequence's last token in the packed step."""
    return (np.asarray(cu_q_lens[1:], dtype=np.int32) - 1).astype(np.int32)


class Executor:
    """What every executor shares (module docstring). ``close()``, or leaving a ``with`` block, releases the
    pools, the device memory and the session."""

    name = "executor"
    manager = None  # also what close() sees when __init__ failed before creating it
    graph = None

    # ---- lifecycle -------------------------------------------------------------------------------------
    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
            self.manager = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def kv_pools(self) -> np.ndarray:
        """The ``kv_pools`` engine input (pool descriptors) of this executor's pools."""
        raise NotImplementedError

    def pad_blocks(self, tokens: int) -> list[np.ndarray]:
        """Per pool group, the block list of ``PAD_SEQUENCE``, holding room for ``tokens`` positions (taken on
        first use, grown when asked for more): the pages ``pad_decode_step``'s padding rows write into. It stays
        a sequence of the manager until the executor closes."""
        mgr = self.manager
        if PAD_SEQUENCE not in mgr:
            mgr.add_sequence(PAD_SEQUENCE)
        if mgr.reserved(PAD_SEQUENCE) < tokens:
            mgr.reserve(PAD_SEQUENCE, tokens)
        return [mgr.block_row(PAD_SEQUENCE, g) for g in range(len(mgr.groups))]

    def _run(self, feed: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    # ---- steps -----------------------------------------------------------------------------------------
    def feed(self, inputs: StepInputs) -> dict[str, np.ndarray]:
        """The engine inputs of a step, by their ``pagedkv.engine_io`` names."""
        batch, graph = inputs.batch, self.graph
        feed = {engine_io.INPUT_IDS: np.asarray(inputs.input_ids, dtype=np.int64).reshape(1, -1),
                engine_io.KV_POOLS: self.kv_pools(), engine_io.CU_Q_LENS: batch.cu_q_lens,
                engine_io.PAST_LENS: batch.past_lens}
        for g in range(graph.num_groups):
            feed[engine_io.block_table_name(g)] = _to_width(batch.meta(g).block_table, graph.max_blocks)
        if graph.explicit_positions:
            feed[engine_io.POSITION_IDS] = batch.positions if batch.position_ids is None else batch.position_ids
        feed[engine_io.LOGITS_ROWS] = np.asarray(inputs.logits_rows, dtype=np.int32)
        if graph.sampling:
            sampling = inputs.sampling or SamplingInputs.greedy(len(inputs.logits_rows))
            feed[engine_io.SAMPLING_PARAMS] = sampling.params
            feed[engine_io.PENALTY_TOKENS] = sampling.penalty_tokens
            feed[engine_io.PENALTY_COUNTS] = sampling.penalty_counts
        return feed

    def output_names(self, inputs: StepInputs) -> list[str]:
        heads = list(engine_io.SAMPLING_OUTPUTS) if self.graph.sampling and inputs.sampling is not None else []
        if inputs.want_logits or not heads:
            heads.insert(0, engine_io.LOGITS)
        return heads + list(self.graph.status_outputs)

    def execute(self, inputs: StepInputs) -> StepOutputs:
        """Run one step whose KV bookkeeping is done (reserved, ``build_step``). A failed KV write raises
        ``KVWriteError`` (the caller unreserves); nothing is committed here."""
        names = self.output_names(inputs)
        got = self._run(self.feed(inputs), names)
        for name in self.graph.status_outputs:
            raise_for_status(got[name], where=f"{name} (step of sequences {list(inputs.batch.seq_ids)})")
        out = StepOutputs()
        if engine_io.LOGITS in got:
            out.logits = np.asarray(got[engine_io.LOGITS], dtype=np.float32).reshape(-1, self.graph.vocab)
        if engine_io.NEXT_TOKENS in got:
            out.next_tokens, out.next_logprobs, out.top_tokens, out.top_logprobs = (
                got[engine_io.NEXT_TOKENS], got[engine_io.NEXT_LOGPROBS], got[engine_io.TOP_TOKENS],
                got[engine_io.TOP_LOGPROBS])
        return out

    # ---- one-call steps (compare, tests) ---------------------------------------------------------------
    def has_sequence(self, seq_id) -> bool:
        return seq_id in self.manager

    def free(self, seq_id) -> None:
        self.manager.free(seq_id)

    def step(self, entries: StepEntries) -> list[np.ndarray]:
        """Append each entry's new tokens to its sequence (added when new) and return the logits [n_i, vocab]
        of every one of them, in order: the bookkeeping, all rows, then commit. A failed KV write raises
        ``KVWriteError`` and gives the step's reservations back."""
        mgr = self.manager
        for seq_id, tokens in entries:
            if seq_id not in mgr:
                mgr.add_sequence(seq_id)
            mgr.reserve(seq_id, len(tokens))
        with self._unreserve_on_error(entries):
            batch = mgr.build_step([(seq_id, len(tokens)) for seq_id, tokens in entries])
            ids = np.concatenate([np.asarray(t, dtype=np.int64) for _, t in entries])
            out = self.execute(StepInputs(batch, ids, np.arange(batch.num_tokens, dtype=np.int32), want_logits=True))
        for seq_id, tokens in entries:
            mgr.commit(seq_id, len(tokens), token_ids=np.asarray(tokens, dtype=np.int64))
        cu = batch.cu_q_lens
        return [out.logits[cu[i]:cu[i + 1]] for i in range(len(entries))]

    @contextlib.contextmanager
    def _unreserve_on_error(self, entries: StepEntries):
        try:
            yield
        except BaseException:
            for seq_id, _ in entries:
                self.manager.unreserve(seq_id)
            raise


def _to_width(table: np.ndarray, width: int | None) -> np.ndarray:
    """A block table padded with -1 to a graph's static width (``rewrite --max-blocks``)."""
    if width is None or table.shape[1] == width:
        return table
    if table.shape[1] > width:
        raise ValueError(f"block table: {table.shape[1]} pages exceed the graph's static width max_blocks={width}")
    out = np.full((table.shape[0], width), -1, dtype=np.int32)
    out[:, :table.shape[1]] = table
    return out


def pad_decode_step(inputs: StepInputs, *, batch: int, width: int, pad_rows: list[np.ndarray]) -> StepInputs:
    """A decode step (one token per sequence, one logits row each) padded to ``batch`` sequences and block
    tables ``width`` columns wide, so that its shapes repeat (CUDA graphs). Padding sequence j has one token at
    position j (``past_lens = j``) and group g's block list ``pad_rows[g]`` (``Executor.pad_blocks``): the
    padding rows write distinct slots of blocks held for them and attend only to what they wrote in this step.
    Their rows are greedy and their outputs to be ignored (rows past the real ones)."""
    from pagedkv.kvcache.metadata import GroupStep, StepBatch
    from pagedkv.step import StepMetadata

    b = inputs.batch
    B = b.num_seqs
    if b.num_tokens != B or len(inputs.logits_rows) != B:
        raise ValueError(f"pad_decode_step: a decode step has one token and one logits row per sequence, got "
                         f"{b.num_tokens} tokens and {len(inputs.logits_rows)} rows for {B} sequences")
    if batch < B:
        raise ValueError(f"pad_decode_step: batch {batch} < the step's {B} sequences")
    extra = batch - B
    cu = np.arange(batch + 1, dtype=np.int32)
    past = np.concatenate([b.past_lens, np.arange(extra, dtype=np.int32)])
    groups = []
    for g, gs_ in enumerate(b.groups):
        table, pad = gs_.meta.block_table, np.asarray(pad_rows[g], dtype=np.int32)
        if max(table.shape[1], pad.size) > width:
            raise ValueError(f"pad_decode_step: group {g} needs {max(table.shape[1], pad.size)} block-table columns "
                             f"> width {width}")
        padded = np.full((batch, width), -1, dtype=np.int32)
        padded[:B, :table.shape[1]] = table
        padded[B:, :pad.size] = pad
        meta = StepMetadata(block_table=padded, cu_q_lens=cu, past_lens=past)
        groups.append(GroupStep(gs_.name, gs_.pool_index, meta, None, None, None, None))
    positions = np.concatenate([b.positions, np.arange(extra, dtype=np.int32)])
    step = StepBatch(seq_ids=tuple(b.seq_ids) + (None,) * extra, cu_q_lens=cu, past_lens=past,
                     q_lens=np.ones(batch, np.int32), kv_lens=past + 1, token_seq=cu[:-1].copy(),
                     positions=positions, position_ids=None, groups=tuple(groups), max_q_len=1,
                     max_kv_len=int(past.max()) + 1 if batch else 0)
    sampling = inputs.sampling
    if sampling is not None:
        pad = SamplingInputs.greedy(extra)
        w = sampling.penalty_tokens.shape[1]
        sampling = SamplingInputs(np.concatenate([sampling.params, pad.params]),
                                  np.concatenate([sampling.penalty_tokens, np.full((extra, w), -1, np.int32)]),
                                  np.concatenate([sampling.penalty_counts, np.zeros((extra, w), np.float32)]))
    ids = np.concatenate([np.asarray(inputs.input_ids, dtype=np.int64), np.zeros(extra, np.int64)])
    return StepInputs(step, ids, np.arange(batch, dtype=np.int32), sampling, inputs.want_logits)
