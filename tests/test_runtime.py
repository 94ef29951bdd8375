"""The reference runtime's pieces: graph parsing, the PyOp plumbing, the step loop, the pools it writes.

The end-to-end numerics (original vs rewritten) are in test_compare.py; here each piece is checked on its
own: exactly the right pool slots are written (pools start as NaN), a failed KV write surfaces as
``KVWriteError`` naming sequence/page/entry, the kv_pools handle is validated, the schedule mixes prefill
chunks and decodes, and chunked prefill leaves the same pool as one-shot prefill.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
from pagedkv.runtime import DecoderGraph, DenseSession, GraphError, OrtExecutor, RewrittenGraph, SamplingInputs
from pagedkv.runtime import ops
from pagedkv.runtime.loop import Prompt, Schedule, generate_greedy
from pagedkv.runtime.backends import status_from_error
from pagedkv.config import ATTENTION_PLUGIN_NAME, WRITE_PLUGIN_NAME
from pagedkv.onnx_export.synthetic import SyntheticConfig, make_synthetic_model
from pagedkv.step import (POOL_DESC_FIELDS, STATUS_BLOCK_OUT_OF_RANGE, STATUS_FLAGS, STATUS_INVALID_BLOCK,
                          STATUS_PAST_BLOCK_TABLE, KVWriteError, raise_for_status)

CFG = SyntheticConfig(num_layers=2, hidden=64, vocab=128, intermediate=128)


@pytest.fixture(scope="module")
def models():
    original = make_synthetic_model(CFG)
    return original, rewrite_model(original, RewriteOptions(page_size=16)).model


def test_rewritten_graph_is_parsed(models):
    graph = RewrittenGraph.load(models[1])
    assert [layer.index for layer in graph.layers] == [0, 1]
    assert graph.num_groups == 1 and graph.group_layers == ((0, 1),)
    spec = graph.groups[0]
    assert (spec.layout.num_layers, spec.layout.num_kv_heads, spec.layout.head_dim, spec.page_size) == (2, 2, 64, 16)
    assert all(layer.io_dtype == "float32" for layer in graph.layers)
    assert graph.layers[1].write.pool.layer_index == 1 and graph.layers[1].attention.num_q_heads == 4


def test_original_signature_both_namings():
    d = DecoderGraph.load(make_synthetic_model(CFG))
    assert d.past == (("past_key_values.0.key", "past_key_values.0.value"),
                      ("past_key_values.1.key", "past_key_values.1.value"))
    assert d.kv_heads == (2, 2) and d.head_dims == (64, 64)
    # dynamo-style names
    vi = lambda n, shape: helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)  # noqa: E731
    ins = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"]),
           vi("input.cache.layers.0.keys", ["b", 3, "p", 64]), vi("input.cache.layers.0.values", ["b", 3, "p", 64])]
    outs = [vi("logits", ["b", "s", 8]), vi("present.0.key", ["b", 3, "t", 64]), vi("present.0.value", ["b", 3, "t", 64])]
    g = helper.make_graph([], "g", ins, outs)
    d = DecoderGraph.load(helper.make_model(g))
    assert d.past == (("input.cache.layers.0.keys", "input.cache.layers.0.values"),) and d.kv_heads == (3,)


def test_rewritten_graph_errors_name_what_is_missing(models):
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(models[1])
    kv = next(i for i in rewritten.graph.input if i.name == "kv_pools")
    rewritten.graph.input.remove(kv)
    with pytest.raises(GraphError, match=r"kv_pools"):
        RewrittenGraph.load(rewritten)
    with pytest.raises(GraphError, match="it is a rewritten graph"):
        DecoderGraph.load(models[1])  # a rewritten graph is not a decoder-with-past graph


@pytest.mark.parametrize("attribute,value", [("plugin_namespace", "other"), ("plugin_version", "2")])
def test_plugin_identity_attributes_are_read_and_checked(models, attribute, value):
    """The rewrite writes plugin_namespace / plugin_version (TensorRT's parser looks the creator up with them); the
    reader accepts them and refuses a node that names another plugin identity."""
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(models[1])
    node = next(n for n in rewritten.graph.node if n.op_type == ATTENTION_PLUGIN_NAME)
    attr = next(a for a in node.attribute if a.name == attribute)
    assert attr.type == onnx.AttributeProto.STRING
    RewrittenGraph.load(rewritten)
    attr.s = value.encode()
    with pytest.raises(GraphError, match=f"attribute {attribute}='{value}', expected"):
        RewrittenGraph.load(rewritten)


def test_session_model_moves_plugins_to_pyop_domain(models):
    graph = RewrittenGraph.load(models[1])
    bindings = {}
    for layer in graph.layers:
        bindings[layer.write_node] = (ops.variant_name(WRITE_PLUGIN_NAME, "float32"), 7)
        bindings[layer.attention_node] = (ops.variant_name(ATTENTION_PLUGIN_NAME, "float32"), 8)
    copy = ops.session_model(graph.model, bindings)
    plugin_nodes = [n for n in copy.graph.node if n.domain == ops.PYOP_DOMAIN]
    assert len(plugin_nodes) == 4
    assert all([a.name for a in n.attribute] == ["binding"] for n in plugin_nodes)
    assert "pagedkv" not in {o.domain for o in copy.opset_import}
    # the original is untouched
    assert sum(n.domain == "pagedkv" for n in graph.model.graph.node) == 4
    with pytest.raises(ValueError, match="io dtype"):
        ops.variant_name(WRITE_PLUGIN_NAME, "bfloat16")
    with pytest.raises(ValueError, match="has no runtime binding"):
        ops.session_model(graph.model, {})


def test_kv_pools_handles_are_checked():
    pool = np.zeros((3, 1, 2, 1, 16, 64), dtype=np.float16)
    handle = ops.register_host_pool(pool)
    try:
        desc = np.zeros((1, POOL_DESC_FIELDS), dtype=np.int64)
        desc[0, :2] = handle, 3
        assert ops.resolve_host_pool(desc, 0) is pool
        desc[0, 1] = 4
        with pytest.raises(ValueError, match=r"kv_pools\[0\]: num_blocks=4 but the pool holds 3"):
            ops.resolve_host_pool(desc, 0)
        with pytest.raises(ValueError, match=r"no row pool_index=1"):
            ops.resolve_host_pool(desc, 1)
    finally:
        ops.release_host_pool(handle)
    with pytest.raises(ValueError, match="not a registered host pool handle"):
        ops.resolve_host_pool(desc, 0)


@pytest.mark.parametrize("entry,page,max_blocks,flag", [
    (-1, 0, 4, STATUS_INVALID_BLOCK), (99, 1, 4, STATUS_BLOCK_OUT_OF_RANGE), (-1, 4, 4, STATUS_PAST_BLOCK_TABLE)])
def test_status_from_error_matches_the_plugin_record(entry, page, max_blocks, flag):
    status = status_from_error(KVWriteError("x", 2, page, entry), max_blocks)
    assert status[STATUS_FLAGS] == flag and list(status[1:]) == [2, page, entry]
    with pytest.raises(KVWriteError) as exc:
        raise_for_status(status)
    assert (exc.value.seq, exc.value.page_in_seq, exc.value.entry) == (2, page, entry)


def test_schedule_mixes_chunks_and_decodes():
    sched = Schedule([Prompt("a", np.arange(5)), Prompt("b", np.arange(20))], decode_steps=3, chunk_size=8)
    seen = []
    while entries := sched.next_step():
        seen.append([(sid, len(t)) for sid, t in entries])
        sched.advance([100 + i for i in range(len(entries))])
    assert seen == [[("a", 5), ("b", 8)], [("a", 1), ("b", 8)], [("a", 1), ("b", 4)], [("a", 1), ("b", 1)],
                    [("b", 1)], [("b", 1)]]
    a, b = sched.requests
    assert len(a.generated) == 3 and len(b.generated) == 3
    with pytest.raises(ValueError, match="empty"):
        Prompt("c", [])
    with pytest.raises(ValueError, match="decode_steps"):
        Schedule([], decode_steps=-1)


def _touched_slots(pool):
    """Boolean mask of the pool's (block, layer, kv, head, offset) rows holding any non-NaN value."""
    return ~np.all(np.isnan(pool.astype(np.float32)), axis=-1)


def test_exactly_the_assigned_slots_are_written(models):
    original, rewritten = models
    prompts = [np.arange(1, 20) % 128, (np.arange(7) * 5) % 128]
    with OrtExecutor(rewritten, num_blocks=8) as paged:
        pool = paged.manager.pool(0)
        assert np.isnan(pool.astype(np.float32)).all()  # the manager poisons new pools
        logits = paged.step([(sid, p) for sid, p in enumerate(prompts)])  # one packed prefill step
        assert [lg.shape for lg in logits] == [(19, CFG.vocab), (7, CFG.vocab)]
        lay = paged.graph.groups[0].layout
        expected = np.zeros(pool.shape[:-1], dtype=bool)
        for sid, prompt in enumerate(prompts):
            row = paged.manager.block_row(sid, 0)
            blocks, offsets, _ = lay.locate(row, np.arange(len(prompt)), pool.shape[0])
            assert (blocks >= 0).all()
            expected[blocks, :, :, :, offsets] = True  # all layers, K and V, all heads (HND)
            # V page tail past the prefill's last token is zeroed, K tail untouched
            last_block, last_off = blocks[-1], offsets[-1]
            expected[last_block, :, 1, :, last_off + 1:] = True
            assert np.all(pool[last_block, :, 1, :, last_off + 1:] == 0)
        assert np.array_equal(_touched_slots(pool), expected)


def test_chunked_prefill_writes_the_same_pool_as_one_shot(models):
    _, rewritten = models
    prompt = (np.arange(37) * 7) % 128
    pools = []
    for chunk in (0, 5, 16):
        with OrtExecutor(rewritten, num_blocks=6) as paged:
            generate_greedy(paged, [prompt], max_new_tokens=0, chunk_size=chunk)
            pools.append(paged.manager.pool(0).astype(np.float32))
    # the positions (rows) are what matters; allocation order is the same for every schedule
    finite = ~np.isnan(pools[0])
    for other in pools[1:]:
        assert np.array_equal(~np.isnan(other), finite)
        np.testing.assert_array_equal(other[finite], pools[0][finite])


def test_paged_and_dense_generate_the_same_tokens(models):
    original, rewritten = models
    prompts = [np.arange(3, 14), np.arange(40, 45), np.arange(60, 81)]
    dense_tokens = generate_greedy(DenseSession(original), prompts, max_new_tokens=8, chunk_size=4)
    with OrtExecutor(rewritten) as paged:
        paged_tokens = generate_greedy(paged, prompts, max_new_tokens=8, chunk_size=4)
        assert all(len(t) == 8 for t in paged_tokens)
        assert not paged.manager.sequences  # generate frees finished sequences
    assert paged_tokens == dense_tokens


def test_invalid_block_table_raises_kv_write_error(models):
    _, rewritten = models
    with OrtExecutor(rewritten, num_blocks=4) as paged:
        feed = {"input_ids": np.array([[1, 2, 3]], dtype=np.int64), "kv_pools": paged.backend.kv_pools(),
                "cu_q_lens": np.array([0, 3], dtype=np.int32), "past_lens": np.array([16], dtype=np.int32),
                "block_table_0": np.array([[0, -1]], dtype=np.int32),  # position 16 lands on page 1: -1
                "logits_rows": np.array([2], dtype=np.int32)}
        greedy = SamplingInputs.greedy(1)
        feed.update(sampling_params=greedy.params, penalty_tokens=greedy.penalty_tokens,
                    penalty_counts=greedy.penalty_counts)
        logits, *statuses = paged.session.run(["logits", *paged.graph.status_outputs], feed)
        pool = paged.manager.pool(0)
        assert np.isnan(pool.astype(np.float32)).all(), "the reference wrote although a page was invalid"
        assert all(s[STATUS_FLAGS] == STATUS_INVALID_BLOCK for s in statuses)
        with pytest.raises(KVWriteError, match=r"block_table\[0\]\[1\] = -1") as exc:
            raise_for_status(statuses[0])
        assert (exc.value.seq, exc.value.page_in_seq, exc.value.entry) == (0, 1, -1)


def test_session_step_rolls_back_the_reservation_on_failure(models, monkeypatch):
    _, rewritten = models
    with OrtExecutor(rewritten, num_blocks=4) as paged:
        paged.step([("a", np.arange(5))])
        free_before = paged.manager.num_free(0)

        def refuse(*args):
            raise KVWriteError("injected: page refused", 0, 0, -1)

        original_write = paged.backend.write

        def failing_write(cfg, qkv, *rest):
            try:
                refuse()
            except KVWriteError as err:
                return np.full((qkv.shape[0], cfg.num_q_heads * cfg.pool.head_dim), np.nan, np.float32), \
                    status_from_error(err, 1)

        monkeypatch.setattr(paged.backend, "write", failing_write)
        with pytest.raises(KVWriteError, match="kv_write_status_0"):
            paged.step([("a", np.arange(20))])  # needs a second page: reserved, then rolled back
        assert paged.manager.length("a") == 5 and paged.manager.num_free(0) == free_before
        monkeypatch.setattr(paged.backend, "write", original_write)
        (logits,) = paged.step([("a", np.arange(3))])
        assert logits.shape == (3, CFG.vocab) and np.isfinite(logits).all()
