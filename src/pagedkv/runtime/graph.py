"""What the runtimes need to know about the two graphs they run, read off the ONNX files alone.

``RewrittenGraph``: the plugin nodes of every layer with their parsed configs (``WriteConfig`` /
``AttentionConfig.from_attributes`` validate every attribute), its engine inputs and outputs
(``pagedkv.engine_io``), the pool groups (a ``PoolGroup`` per ``kv_pools`` row) and its heads (``logits_rows``,
the sampling head: ``pagedkv.builder.logits_head``). ``DecoderGraph``: the
decoder-with-past signature of an original graph (which inputs are layer i's past key / value, in either
exporter's naming).

Layer i of the rewritten graph is the write node producing output ``kv_write_status_{i}``; its attention node
is the consumer of that status. Layer i of the original graph is ``present.{i}.*`` / its past inputs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import onnx
from onnx import helper

from pagedkv import engine_io, onnx_io
from pagedkv.config import ATTENTION_PLUGIN_NAME, ONNX_DOMAIN, WRITE_PLUGIN_NAME, AttentionConfig, WriteConfig
from pagedkv.pool_group import PoolGroup


class GraphError(ValueError):
    """The graph does not have the structure the runtime needs; the message names what is missing."""


def is_rewritten(model: onnx.ModelProto) -> bool:
    """Whether ``model`` is a rewritten graph (``pagedkv rewrite`` output): it has the plugin nodes or the
    engine input ``kv_pools``. How the verbs tell the two graphs of the flow apart."""
    return (any(i.name == engine_io.KV_POOLS for i in model.graph.input)
            or any(n.domain == ONNX_DOMAIN for n in model.graph.node))


def node_attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _elem_type_name(elem_type: int) -> str:
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name


@dataclass(frozen=True)
class PluginLayer:
    index: int  # layer i (engine output kv_write_status_{i})
    write_node: str
    attention_node: str
    write: WriteConfig
    attention: AttentionConfig
    io_dtype: str  # numpy name of the qkv / q / out dtype ("float32", "float16", ...)

    @property
    def pool_index(self) -> int:
        return self.write.pool.pool_index


@dataclass(frozen=True)
class RewrittenGraph:
    model: onnx.ModelProto
    layers: tuple[PluginLayer, ...]
    groups: tuple[PoolGroup, ...]  # group g: kv_pools row g, engine input block_table_{g}
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    logits: str
    explicit_positions: bool
    vocab: int
    sampling: bool  # the sampling head is there (next_tokens, ...)
    num_top_logprobs: int  # N of top_tokens / top_logprobs (0 without the sampling head)
    max_blocks: int | None  # static block-table width (``pagedkv rewrite --max-blocks``), None: dynamic

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def group_layers(self) -> tuple[tuple[int, ...], ...]:
        """Model layer indices of each group, by layer_index in the group."""
        return tuple(g.layers for g in self.groups)

    @property
    def status_outputs(self) -> tuple[str, ...]:
        """The engine outputs ``kv_write_status_{i}``, in layer order."""
        return tuple(engine_io.status_name(layer.index) for layer in self.layers)

    @classmethod
    def load(cls, model: onnx.ModelProto | str | bytes) -> "RewrittenGraph":
        """From a ModelProto, a path (``onnx_io.load``: any size) or serialized bytes."""
        if isinstance(model, bytes):
            model = onnx.load_from_string(model)
        return cls._parse(onnx_io.load_if_path(model, "rewritten graph"))

    @classmethod
    def _parse(cls, model: onnx.ModelProto) -> "RewrittenGraph":
        graph = model.graph
        inputs = tuple(i.name for i in graph.input)
        outputs = tuple(o.name for o in graph.output)
        missing = [n for n in engine_io.REQUIRED_INPUTS if n not in inputs]
        inits = {i.name for i in graph.initializer}
        if missing and not is_rewritten(model) and any(_rank(i) == 4 for i in graph.input if i.name not in inits):
            raise GraphError("rewritten graph: this is a decoder-with-past graph from before the rewrite (past K/V "
                             "inputs, no pagedkv plugin nodes); run `pagedkv rewrite` on it first")
        if missing:
            raise GraphError(f"rewritten graph: engine input(s) {missing} missing; inputs are {list(inputs)} "
                             "(is this the output of `pagedkv rewrite`? graphs rewritten before logits_rows existed "
                             "need rewriting again)")
        if engine_io.LOGITS not in outputs:
            raise GraphError(f"rewritten graph: no `{engine_io.LOGITS}` output; outputs are {list(outputs)}")
        producers = {o: n for n in graph.node for o in n.output}
        consumers: dict[str, list] = {}
        for n in graph.node:
            for i in n.input:
                consumers.setdefault(i, []).append(n)
        types = _value_types(model)

        layers = []
        for out in outputs:
            idx = engine_io.status_layer(out)
            if idx is None:
                continue
            wnode = producers.get(out)
            if wnode is None or wnode.op_type != WRITE_PLUGIN_NAME or wnode.domain != ONNX_DOMAIN:
                raise GraphError(f"output {out}: expected it to come from a {ONNX_DOMAIN}::{WRITE_PLUGIN_NAME} node, "
                                 f"got {'nothing' if wnode is None else wnode.domain + '::' + wnode.op_type}")
            anodes = [n for n in consumers.get(out, []) if n.op_type == ATTENTION_PLUGIN_NAME]
            if len(anodes) != 1:
                raise GraphError(f"layer {idx}: expected exactly one {ATTENTION_PLUGIN_NAME} node reading {out}, "
                                 f"found {len(anodes)}")
            anode = anodes[0]
            try:
                wcfg = WriteConfig.from_attributes(node_attributes(wnode))
                acfg = AttentionConfig.from_attributes(node_attributes(anode))
            except (ValueError, TypeError) as exc:
                raise GraphError(f"layer {idx}: bad plugin attributes: {exc}") from exc
            _check_layer(idx, wnode, anode, wcfg, acfg, inputs)
            io_dtype = types.get(wnode.input[0])
            if io_dtype is None:
                raise GraphError(f"layer {idx}: the element type of {wnode.name}'s qkv input "
                                 f"{wnode.input[0]!r} is unknown after shape inference")
            layers.append(PluginLayer(idx, wnode.name, anode.name, wcfg, acfg, io_dtype))
        if not layers:
            raise GraphError(f"rewritten graph: no {engine_io.KV_WRITE_STATUS} outputs, so no plugin layers")
        layers.sort(key=lambda layer: layer.index)
        if [layer.index for layer in layers] != list(range(len(layers))):
            raise GraphError(f"rewritten graph: layer indices {[layer.index for layer in layers]} are not 0..N-1")

        by_pool: dict[int, list[PluginLayer]] = {}
        for layer in layers:
            by_pool.setdefault(layer.pool_index, []).append(layer)
        if sorted(by_pool) != list(range(len(by_pool))):
            raise GraphError(f"pool_index values {sorted(by_pool)} are not 0..G-1")
        groups = []
        for g in range(len(by_pool)):
            members = sorted(by_pool[g], key=lambda layer: layer.write.pool.layer_index)
            pools = [m.write.pool for m in members]
            first = pools[0]
            if [p.layer_index for p in pools] != list(range(first.num_layers)):
                raise GraphError(f"pool group {g}: layer_index values {[p.layer_index for p in pools]} do not "
                                 f"cover 0..{first.num_layers - 1} exactly once")
            geometry = {(p.num_kv_heads, p.head_dim, p.page_size, p.num_layers, int(p.cache_dtype), int(p.page_layout),
                         p.ring_sink_tokens, p.cyclic_len) for p in pools}
            windows = {(m.attention.window, m.attention.attention_sinks) for m in members}
            if len(geometry) != 1 or len(windows) != 1:
                raise GraphError(f"pool group {g}: its layers {[m.index for m in members]} disagree on geometry "
                                 f"{sorted(geometry)} or window {sorted(windows)}")
            window, sinks = windows.pop()
            try:
                groups.append(PoolGroup(f"group{g}", first.layout(), first.cache_dtype, window=max(window, 0),
                                        attention_sinks=sinks if window > 0 else 0,
                                        k_scales=tuple(p.k_scale for p in pools),
                                        v_scales=tuple(p.v_scale for p in pools),
                                        layers=tuple(m.index for m in members)))
            except ValueError as exc:
                raise GraphError(f"pool group {g}: {exc}") from exc
            if engine_io.block_table_name(g) not in inputs:
                raise GraphError(f"pool group {g}: engine input {engine_io.block_table_name(g)} missing")
        explicit = {layer.write.explicit_positions for layer in layers}
        if len(explicit) != 1:
            raise GraphError("layers disagree on explicit_positions")
        explicit_positions = explicit.pop()
        if explicit_positions and engine_io.POSITION_IDS not in inputs:
            raise GraphError(f"explicit_positions=1 but the graph has no {engine_io.POSITION_IDS} input")
        heads = [n for n in engine_io.SAMPLING_INPUTS + engine_io.SAMPLING_OUTPUTS if n in inputs + outputs]
        if heads and len(heads) != len(engine_io.SAMPLING_INPUTS + engine_io.SAMPLING_OUTPUTS):
            raise GraphError(f"rewritten graph: a partial sampling head ({heads}); expected all of "
                             f"{list(engine_io.SAMPLING_INPUTS + engine_io.SAMPLING_OUTPUTS)} or none")
        dims = {o.name: o.type.tensor_type.shape.dim for o in graph.output}
        vocab = dims[engine_io.LOGITS][-1] if dims[engine_io.LOGITS] else None
        if vocab is None or not vocab.HasField("dim_value"):
            raise GraphError(f"rewritten graph: `{engine_io.LOGITS}` needs a static vocabulary dimension")
        top = dims[engine_io.TOP_TOKENS][-1].dim_value if heads else 0
        width = next(i.type.tensor_type.shape.dim[1] for i in graph.input if i.name == engine_io.block_table_name(0))
        return cls(model, tuple(layers), tuple(groups), inputs, outputs, engine_io.LOGITS, bool(explicit_positions),
                   int(vocab.dim_value), bool(heads), int(top),
                   int(width.dim_value) if width.HasField("dim_value") else None)


def _check_layer(idx, wnode, anode, wcfg: WriteConfig, acfg: AttentionConfig, inputs) -> None:
    expected_w = 5 + int(wcfg.explicit_positions) + int(wcfg.has_bias)
    if len(wnode.input) != expected_w:
        raise GraphError(f"layer {idx}: {wnode.name} has {len(wnode.input)} inputs, expected {expected_w} "
                         f"(explicit_positions={int(wcfg.explicit_positions)}, has_bias={int(wcfg.has_bias)})")
    if len(anode.input) != 6 or len(anode.output) != 1 or len(wnode.output) != 2:
        raise GraphError(f"layer {idx}: {anode.name} must have 6 inputs and 1 output and {wnode.name} 2 outputs")
    expected = [engine_io.KV_POOLS, engine_io.block_table_name(wcfg.pool.pool_index), engine_io.CU_Q_LENS,
                engine_io.PAST_LENS]
    for node, role in ((wnode, "write"), (anode, "attention")):
        if list(node.input[1:5]) != expected:
            raise GraphError(f"layer {idx}: {role} node {node.name} inputs 1..4 are {list(node.input[1:5])}, "
                             f"expected {expected}")
    if anode.input[0] != wnode.output[0] or anode.input[5] != wnode.output[1]:
        raise GraphError(f"layer {idx}: {anode.name} must read {wnode.name}'s q and kv_write_status")
    if wcfg.explicit_positions and wnode.input[5] != engine_io.POSITION_IDS:
        raise GraphError(f"layer {idx}: {wnode.name} input 5 should be {engine_io.POSITION_IDS}, "
                         f"got {wnode.input[5]!r}")
    if wcfg.pool != acfg.pool or wcfg.num_q_heads != acfg.num_q_heads:
        raise GraphError(f"layer {idx}: write and attention nodes disagree: {wcfg.pool} / {wcfg.num_q_heads} "
                         f"heads vs {acfg.pool} / {acfg.num_q_heads} heads")


def _value_types(model: onnx.ModelProto) -> dict[str, str]:
    """numpy dtype name of every typed value (after onnx shape inference, which the rewrite makes work; on the
    weightless skeleton, so any size works)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(onnx_io.skeleton(model))
    except Exception:  # custom-domain outputs without registered inference: use what the file states
        inferred = model
    out = {}
    g = inferred.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            out[vi.name] = _elem_type_name(vi.type.tensor_type.elem_type)
    for init in g.initializer:
        out[init.name] = _elem_type_name(init.data_type)
    return out


# ---- the original (decoder with past) -----------------------------------------------------------------
def passthrough_state(graph: onnx.GraphProto) -> dict[str, list[str]]:
    """Graph inputs that only pass through to graph outputs (every reader an Identity producing an output): state
    an exporter carries along with the cache and nothing reads, as transformers' exporter does with a sliding-window
    layer's ``_sliding_window_tensor``. -> {input: its outputs}."""
    outputs = {o.name for o in graph.output}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    found = {}
    for vi in graph.input:
        nodes = readers.get(vi.name, [])
        if nodes and all(n.op_type == "Identity" and n.output[0] in outputs for n in nodes):
            found[vi.name] = [n.output[0] for n in nodes]
    return found



_LAYER = re.compile(r"(\d+)")


def _kv_role(suffix: str) -> str | None:
    """'key' / 'value' from what follows the layer number (``past_key_values.3.value`` -> '.value')."""
    low = suffix.lower()
    if "key" in low or re.search(r"(^|[._])k($|[._])", low):
        return "key"
    if "value" in low or re.search(r"(^|[._])v($|[._])", low):
        return "value"
    return None


@dataclass(frozen=True)
class DecoderGraph:
    """Signature of an original decoder-with-past graph."""

    input_ids: str
    attention_mask: str | None
    position_ids: str | None
    past: tuple[tuple[str, str], ...]  # (key, value) input per layer
    present: tuple[tuple[str, str], ...]  # (key, value) output per layer
    logits: str
    kv_heads: tuple[int, ...]
    head_dims: tuple[int, ...]  # 0 where the graph leaves it symbolic (DenseSession takes it from the caller)
    past_dtype: str
    passthrough: tuple[tuple[str, int], ...] = ()  # (input, ONNX elem type) of passthrough_state: fed, never read

    @property
    def num_layers(self) -> int:
        return len(self.past)

    @classmethod
    def load(cls, model: onnx.ModelProto | str) -> "DecoderGraph":
        model = onnx_io.load_if_path(model, "original graph")
        g = model.graph
        inits = {i.name for i in g.initializer}
        inputs = [i for i in g.input if i.name not in inits]
        names = [i.name for i in inputs]
        if is_rewritten(model):
            raise GraphError("original graph: it has the pagedkv plugin nodes, so it is a rewritten graph; pass the "
                             "decoder-with-past graph from before `pagedkv rewrite`")
        ids = next((n for n in names if n == "input_ids"), None)
        if ids is None:
            raise GraphError(f"original graph: no input_ids input; inputs are {names}")
        mask = "attention_mask" if "attention_mask" in names else None
        pos = "position_ids" if "position_ids" in names else None
        past = _pair_by_layer([i for i in inputs if _rank(i) == 4], "past input")
        if not past:
            raise GraphError(f"original graph: no rank-4 past key/value inputs; inputs are {names}")
        passthrough = passthrough_state(g)
        carried = {o for outs in passthrough.values() for o in outs}
        present = _pair_by_layer([o for o in g.output if o.name != "logits" and o.name not in carried],
                                 "present output")
        if "logits" not in [o.name for o in g.output]:
            raise GraphError(f"original graph: no logits output; outputs are {[o.name for o in g.output]}")
        if len(past) != len(present):
            raise GraphError(f"original graph: {len(past)} past layers but {len(present)} present layers")
        by_name = {i.name: i for i in (*inputs, *g.output)}
        kv_heads, head_dims = [], []
        for (k, _), (present_k, _) in zip(past, present):
            # the past input's [batch, kv_heads, past, head_dim], else its present's (one exporter names the
            # past's static dims); a head dim symbolic in both (ONNX Runtime GenAI's kv_cache_dim) stays 0
            dims = [[d.dim_value if d.HasField("dim_value") else 0 for d in by_name[n].type.tensor_type.shape.dim]
                    for n in (k, present_k)]
            kvh = next((d[1] for d in dims if len(d) == 4 and d[1]), 0)
            if not kvh:
                raise GraphError(f"original graph: past input {k} needs a static kv_heads dim")
            kv_heads.append(kvh)
            head_dims.append(next((d[3] for d in dims if len(d) == 4 and d[3]), 0))
        past_dtype = _elem_type_name(by_name[past[0][0]].type.tensor_type.elem_type) if past else "float32"
        state = tuple((name, by_name[name].type.tensor_type.elem_type) for name in passthrough)
        return cls(ids, mask, pos, tuple(past), tuple(present), "logits", tuple(kv_heads), tuple(head_dims),
                   past_dtype, state)


def _rank(vi) -> int:
    t = vi.type.tensor_type
    return len(t.shape.dim) if t.HasField("shape") else -1


def _pair_by_layer(values, what: str) -> list[tuple[str, str]]:
    layers: dict[int, dict[str, str]] = {}
    for v in values:
        m = _LAYER.search(v.name)
        role = _kv_role(v.name[m.end():]) if m else None
        if not m or role is None:
            raise GraphError(f"original graph: cannot tell the layer and key/value of {what} {v.name!r}")
        slot = layers.setdefault(int(m.group(1)), {})
        if role in slot:
            raise GraphError(f"original graph: two {what}s for layer {m.group(1)} {role}: {slot[role]}, {v.name}")
        slot[role] = v.name
    if sorted(layers) != list(range(len(layers))):
        raise GraphError(f"original graph: {what} layers {sorted(layers)} are not 0..N-1")
    out = []
    for i in range(len(layers)):
        if set(layers[i]) != {"key", "value"}:
            raise GraphError(f"original graph: layer {i} lacks a {what} for {({'key', 'value'} - set(layers[i]))}")
        out.append((layers[i]["key"], layers[i]["value"]))
    return out
