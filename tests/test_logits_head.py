"""The heads the rewrite puts on a decoder (``pagedkv.builder.logits_head``): logits only for ``logits_rows``,
gathered before the LM-head MatMul (or, where no LM head is recognizable, on the logits themselves), and the
sampling head present or not (``RewriteOptions.sampling``)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper
from runtime_support import SMALL

from pagedkv import engine_io
from pagedkv.builder.rewrite import RewriteOptions, rewrite_model
from pagedkv.onnx_export.synthetic import make_synthetic_model
from pagedkv.runtime import OrtExecutor, StepInputs


def _rows_logits(model: onnx.ModelProto, prompt, rows):
    with OrtExecutor(model, num_blocks=8) as ex:
        mgr = ex.manager
        mgr.add_sequence("s")
        mgr.reserve("s", len(prompt))
        batch = mgr.build_step([("s", len(prompt))])
        return ex.execute(StepInputs(batch, np.asarray(prompt), np.asarray(rows, np.int32), want_logits=True)).logits


def _logits_through_a_reshape(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same decoder with its logits passing through a Reshape (not an op the LM-head walk follows)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    producer = next(n for n in m.graph.node if "logits" in n.output)
    producer.output[list(producer.output).index("logits")] = "logits_raw"
    shape = helper.make_tensor("logits_shape", onnx.TensorProto.INT64, [3], [0, -1, SMALL.vocab])
    m.graph.initializer.append(shape)
    m.graph.node.append(helper.make_node("Reshape", ["logits_raw", "logits_shape"], ["logits"], name="logits_reshape"))
    return m


def test_rows_are_gathered_before_the_lm_head_and_equal_all_rows():
    result = rewrite_model(make_synthetic_model(SMALL), RewriteOptions())
    assert result.report.heads.rows_gathered_at.startswith("lm_head ")
    assert "logits rows gathered before lm_head" in str(result.report)
    gather = next(n for n in result.model.graph.node if n.name.startswith("/pagedkv/logits_head/rows/Gather"))
    matmul = next(n for n in result.model.graph.node if gather.output[0] in n.input)
    assert matmul.op_type == "MatMul" and "logits" in matmul.output
    prompt = np.arange(3, 23) % SMALL.vocab
    every = _rows_logits(result.model, prompt, np.arange(20))
    some = _rows_logits(result.model, prompt, [19, 4, 4, 0])
    np.testing.assert_array_equal(some, every[[19, 4, 4, 0]])


def test_without_an_lm_head_the_logits_themselves_are_gathered():
    original = make_synthetic_model(SMALL)
    result = rewrite_model(_logits_through_a_reshape(original), RewriteOptions())
    assert result.report.heads.rows_gathered_at == "logits (no LM-head MatMul found)"
    prompt = np.arange(5, 18)
    reference = rewrite_model(original, RewriteOptions()).model
    np.testing.assert_allclose(_rows_logits(result.model, prompt, [12, 3]), _rows_logits(reference, prompt, [12, 3]),
                               rtol=1e-6, atol=1e-6)


def test_no_sampling_head_on_request():
    model = rewrite_model(make_synthetic_model(SMALL), RewriteOptions(sampling=False)).model
    names = {i.name for i in model.graph.input} | {o.name for o in model.graph.output}
    assert engine_io.LOGITS_ROWS in names
    assert not names & set(engine_io.SAMPLING_INPUTS + engine_io.SAMPLING_OUTPUTS)
    from pagedkv.runtime import RewrittenGraph

    graph = RewrittenGraph.load(model)
    assert not graph.sampling and graph.num_top_logprobs == 0 and graph.vocab == SMALL.vocab
