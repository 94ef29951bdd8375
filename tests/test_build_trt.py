"""The build path without a builder: limits -> optimization profile, the pre-flight's refusals, the session's fit of
a step to an engine's profile; and, on a GPU with TensorRT (``trt``), engines that run: against the original graph,
with an invalid page, from a timing cache, with the plugin library serialized into a version-compatible engine.

The ``trt`` tests need a TensorRT that runs engines on this GPU (conftest skips them naming why: no GPU, no
TensorRT, or TensorRT-RTX on a compute capability it does not run on). Builds on this CPU machine, with
TensorRT-RTX, are tests/test_engine_build.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import TOLERANCES

from pagedkv.builder import build
from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
from pagedkv.onnx_export.synthetic import SyntheticConfig, export_synthetic
from pagedkv.runtime import RewrittenGraph
from pagedkv.runtime.trt import TrtSession
from pagedkv.userio import UsageError

BASE = SyntheticConfig(num_layers=2, hidden=64, vocab=128, intermediate=128)


@pytest.fixture(scope="module")
def rewritten_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("trt")
    orig = export_synthetic(BASE, d / "orig.onnx")
    path = d / "rewritten.onnx"  # fp16: the plugins take 16-bit activations only
    onnx.save(rewrite_model(str(orig), RewriteOptions(dtype="fp16")).model, str(path))
    return orig, path


# ---- limits -> profile ------------------------------------------------------------------------------------------
def test_profile_covers_every_engine_input(rewritten_path):
    graph = RewrittenGraph.load(str(rewritten_path[1]))
    shapes = build.BuildLimits(max_batch=8, max_tokens=512, max_context=500, opt_batch=2, opt_tokens=64,
                               opt_context=100).profile(graph)
    assert set(shapes) == set(graph.input_names)
    assert shapes["input_ids"] == ((1, 1), (1, 64), (1, 512))
    assert shapes["cu_q_lens"] == ((2,), (3,), (9,))
    assert shapes["past_lens"] == ((1,), (2,), (8,))
    assert shapes["block_table_0"] == ((1, 1), (2, 7), (8, 32))  # 100 / 500 tokens in pages of 16
    assert shapes["kv_pools"] == ((1, 4),) * 3


def test_defaults_tune_for_a_decode_step_of_the_full_batch(rewritten_path):
    graph = RewrittenGraph.load(str(rewritten_path[1]))
    shapes = build.BuildLimits(max_batch=16, max_tokens=256, max_context=64).profile(graph)
    assert shapes["input_ids"][1] == (1, 16) and shapes["past_lens"][1] == (16,)
    assert shapes["block_table_0"][1] == (16, 4)


def test_a_cyclic_pool_group_needs_no_more_pages_than_its_ring(rewritten_path):
    """A ring of 64 slots (a sliding-window cache): the block tables stay 4 pages wide for any context."""
    import dataclasses

    from pagedkv.layout import KVLayout
    from pagedkv.pool_group import PoolGroup

    graph = RewrittenGraph.load(str(rewritten_path[1]))
    ring = PoolGroup("ring", KVLayout(num_layers=2, num_kv_heads=2, page_size=16, head_dim=64, cyclic_len=64),
                     window=64)
    shapes = build.BuildLimits(max_batch=2, max_tokens=32, max_context=100_000).profile(
        dataclasses.replace(graph, groups=(ring,)))
    assert shapes["block_table_0"][2] == (2, 4)


@pytest.mark.parametrize("limits,match", [
    (dict(max_tokens=0), "max-tokens: expected >= 1, got 0"),
    (dict(max_batch=8, opt_batch=9), r"opt-batch: expected a value in \[1, 8\], got 9"),
    (dict(max_batch=8, max_tokens=4), "max-batch=8 exceeds max-tokens=4"),
    (dict(opt_batch=4, opt_tokens=2), "opt-batch=4 exceeds opt-tokens=2"),
    (dict(max_context=2 ** 31), "max-context: expected at most 2147483647"),
    (dict(max_context=2 ** 31 - 1), "exceed int32 cache positions"),
])
def test_limits_errors_name_the_option(rewritten_path, limits, match):
    graph = RewrittenGraph.load(str(rewritten_path[1]))
    with pytest.raises(UsageError, match=match):
        build.BuildLimits(**limits).profile(graph)


def test_preflight_refusals_name_the_input(rewritten_path, tmp_path):
    orig, rew = rewritten_path
    with pytest.raises(UsageError, match="output: .* is also an input"):
        build.preflight(rew, rew)
    bad = tmp_path / "int32_ids.onnx"
    model = onnx.load(str(rew))
    next(i for i in model.graph.input if i.name == "input_ids").type.tensor_type.elem_type = onnx.TensorProto.INT32
    onnx.save(model, str(bad))
    with pytest.raises(UsageError, match=r"engine input 'input_ids' is int32, the engine I/O contract says int64"):
        build.preflight(bad, tmp_path / "m.engine")
    (tmp_path / "garbage.onnx").write_bytes(b"not onnx at all")
    with pytest.raises(UsageError, match="cannot be read as ONNX"):
        build.preflight(tmp_path / "garbage.onnx", tmp_path / "m.engine")


def test_runnable_targets_follow_the_library_architectures(monkeypatch):
    cases = {"80-real,89-real,90": {80, 86, 89, 120, 121}, "90": {120, 121}, "80": {80, 86, 89, 120, 121},
             "75-real": {75}, "86-real": {86, 89}, "120-virtual": {120, 121}}  # sm_86 code runs on 8.9
    for text, expected in cases.items():
        monkeypatch.setattr(build, "_architectures_text", lambda text=text: text)
        assert build._runnable_targets() == expected, text


# ---- the session against the engine's profile ---------------------------------------------------------------
def test_a_step_is_fit_to_the_engine_profile():
    """Without an engine: the profile check and the block-table padding TrtSession.step applies."""
    session = object.__new__(TrtSession)
    session.profile = {"block_table_0": ((1, 8), (4, 8), (8, 8)), "input_ids": ((1, 1), (1, 8), (1, 64))}
    table = np.array([[3, 1], [0, -1]], np.int32)
    padded = session._fit_to_profile("block_table_0", table)
    assert padded.shape == (2, 8) and (padded[:, :2] == table).all() and (padded[:, 2:] == -1).all()
    with pytest.raises(ValueError, match=r"input_ids: this step's shape \[1, 65\] is outside the engine's profile "
                                         r"\[1, 1\]..\[1, 64\]; rebuild the engine with a larger --max-tokens"):
        session._fit_to_profile("input_ids", np.zeros((1, 65), np.int64))
    with pytest.raises(ValueError, match="block_table_0.*--max-context"):
        session._fit_to_profile("block_table_0", np.zeros((2, 9), np.int32))


# ---- engines that run (TensorRT on a GPU) ------------------------------------------------------------------------
SMALL = build.BuildLimits(max_batch=8, max_tokens=256, max_context=256)


@pytest.mark.trt
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,max_blocks", [("fp16", None), ("bf16", 16)], ids=["fp16", "bf16-static-width"])
def test_engine_matches_the_original(tmp_path, dtype, max_blocks):
    """compare --backend trt builds the engine and runs it against the original: bf16 I/O (no trt.nptype) and a
    static --max-blocks width the session pads its tables to."""
    from pagedkv.builder.compare import compare

    orig = export_synthetic(BASE, tmp_path / "orig.onnx")
    rew = tmp_path / "rew.onnx"
    onnx.save(rewrite_model(str(orig), RewriteOptions(dtype=dtype, max_blocks=max_blocks)).model, str(rew))
    atol, rtol = TOLERANCES["bfloat16"]
    report = compare(str(orig), str(rew), backend="trt", prompt_lens=[5, 17, 33], decode_steps=8, chunk_size=8,
                     atol=atol, rtol=rtol)
    assert report.logits_passed and report.greedy_passed, str(report)


@pytest.mark.trt
@pytest.mark.gpu
def test_engine_reports_invalid_pages(rewritten_path, tmp_path):
    from pagedkv.step import KVWriteError

    _, rew = rewritten_path
    engine = build.build_engine(rew, tmp_path / "m.engine", limits=build.BuildLimits(4, 128, 128)).engine
    with TrtSession(str(rew), engine=engine, num_blocks=2) as sess:
        sess.step([("a", np.arange(20))])  # two pages of 16
        # sabotage: drop the sequence's second page from the manager's table (a -1 inside the live range)
        sess.manager._tables[0][sess.manager.state("a").row, 1] = -1
        with pytest.raises(KVWriteError):
            sess.step([("a", np.arange(5))])


@pytest.mark.trt
@pytest.mark.gpu
def test_timing_cache_and_serialized_plugins(rewritten_path, tmp_path):
    from pagedkv.builder.inspect_engine import inspect_engine

    _, rew = rewritten_path
    cache = tmp_path / "timing.cache"
    options = build.BuildOptions(builder="tensorrt", timing_cache=cache, serialize_plugins=True)
    first = build.build_engine(rew, tmp_path / "a.engine", limits=SMALL, options=options)
    assert first.timing_cache == cache and cache.stat().st_size > 0
    second = build.build_engine(rew, tmp_path / "b.engine", limits=SMALL, options=options)
    report = inspect_engine(second.engine)
    assert report.ok and report.io_source == "runtime", report.contract + report.problems + report.notes
