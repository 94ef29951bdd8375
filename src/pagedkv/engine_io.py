"""The rewritten graph's engine inputs and outputs: names, dtypes, shapes, roles, in one place.

The rewrite (``pagedkv.builder.rewrite``) emits these tensors; the reference runtime (``pagedkv.runtime.graph``,
``pagedkv.runtime.session``), the TensorRT session (``pagedkv.runtime.trt``), the build profiles
(``pagedkv.builder.build.BuildLimits``) and the engine check (``check_engine_io``, ``pagedkv inspect``) read them
from here. For the C++ side the same description is generated as ``plugins/include/pagedkv/engine_io.h`` (``python -m pagedkv.engine_io --header``; the test
``tests/test_engine_io.py`` regenerates it and fails on any difference) and as JSON (``--json``,
``describe()``). ``docs/engine_io.md`` is the human-readable contract; its table is ``--markdown``.

Two heads sit on top of the decoder (``pagedkv.builder.logits_head``): the LM head computes logits only for the
rows ``logits_rows`` names (the last token of each sequence when generating; every token for ``compare``), and
the optional sampling head turns those logits into the next token per row, on the device: greedy or sampled
(temperature, top-k, top-p, min-p, repetition / presence / frequency penalties) with one host-drawn uniform per
row, plus logprobs. Its per-row parameters are one record, ``sampling_params`` (columns ``SAMPLING_*``).

The two records inside the tensors — the rows of ``kv_pools`` and the ``kv_write_status_{i}`` error record — are
laid out by the plugins (``plugins/include/pagedkv/step_metadata.h``); ``pagedkv.step`` is their Python twin
and this module takes the widths from there (the generated header checks them against the C++ enums).

Tokens are packed: the step's new tokens of all sequences, sequence after sequence, no padding, as a batch of
one. Symbolic dims (the names the rewritten ONNX graph gives them):

    num_tokens      T, tokens of the step
    batch           B, sequences of the step
    batch_plus_1    B + 1
    max_blocks      MB, block-table columns (a static width with ``pagedkv rewrite --max-blocks``)
    num_pool_groups G, pool groups (static in a graph: one ``kv_pools`` row and one block table each)
    vocab           the model's vocabulary (static)
    num_logits      R, rows whose logits the step computes (``logits_rows``)
    penalty_width   W, distinct penalized tokens per row (sampling head; >= 1, -1 padded)
    top_logprobs    N, top-logprob candidates reported per row (static, a rewrite option)
"""

from __future__ import annotations

import argparse
import enum
import json
import re
import sys
from dataclasses import dataclass

import numpy as np

from pagedkv import step

# ---- names -------------------------------------------------------------------------------------------------
INPUT_IDS = "input_ids"
KV_POOLS = "kv_pools"
CU_Q_LENS = "cu_q_lens"
PAST_LENS = "past_lens"
POSITION_IDS = "position_ids"
BLOCK_TABLE = "block_table_{g}"  # one per pool group g
LOGITS_ROWS = "logits_rows"
SAMPLING_PARAMS = "sampling_params"
PENALTY_TOKENS = "penalty_tokens"
PENALTY_COUNTS = "penalty_counts"
LOGITS = "logits"
NEXT_TOKENS = "next_tokens"
NEXT_LOGPROBS = "next_logprobs"
TOP_TOKENS = "top_tokens"
TOP_LOGPROBS = "top_logprobs"
KV_WRITE_STATUS = "kv_write_status_{i}"  # one per attention layer i

NUM_TOKENS, BATCH, BATCH_PLUS_1, MAX_BLOCKS, NUM_POOL_GROUPS, VOCAB = (
    "num_tokens", "batch", "batch_plus_1", "max_blocks", "num_pool_groups", "vocab")
NUM_LOGITS, PENALTY_WIDTH, NUM_TOP_LOGPROBS = "num_logits", "penalty_width", "num_top_logprobs"
SYMBOLIC_DIMS = (NUM_TOKENS, BATCH, BATCH_PLUS_1, MAX_BLOCKS, NUM_POOL_GROUPS, VOCAB, NUM_LOGITS, PENALTY_WIDTH,
                 NUM_TOP_LOGPROBS)

# ---- the sampling_params record: FLOAT32 [num_logits, SAMPLING_FIELDS], one row per logits row -------------
# temperature (<= 0: greedy), top_k (0: off), top_p (>= 1: off), min_p (0: off), repetition penalty (1: off;
# prompt and output tokens), presence and frequency penalties (0: off; output tokens), and the row's uniform
# draw u in [0, 1) that picks the sampled token by inverse CDF.
(SAMPLING_TEMPERATURE, SAMPLING_TOP_K, SAMPLING_TOP_P, SAMPLING_MIN_P, SAMPLING_REPETITION, SAMPLING_PRESENCE,
 SAMPLING_FREQUENCY, SAMPLING_UNIFORM) = range(8)
SAMPLING_FIELDS = 8
SAMPLING_COLUMNS = {"temperature": SAMPLING_TEMPERATURE, "top_k": SAMPLING_TOP_K, "top_p": SAMPLING_TOP_P,
                    "min_p": SAMPLING_MIN_P, "repetition_penalty": SAMPLING_REPETITION,
                    "presence_penalty": SAMPLING_PRESENCE, "frequency_penalty": SAMPLING_FREQUENCY,
                    "uniform": SAMPLING_UNIFORM}


def block_table_name(group: int) -> str:
    return BLOCK_TABLE.format(g=group)


def status_name(layer: int) -> str:
    return KV_WRITE_STATUS.format(i=layer)


# ---- the tensors -------------------------------------------------------------------------------------------
class Per(enum.Enum):
    ENGINE = "engine"  # one tensor
    POOL_GROUP = "pool_group"  # one per pool group: the name's {g}
    LAYER = "layer"  # one per attention layer: the name's {i}


class Presence(enum.Enum):
    ALWAYS = "always"
    EXPLICIT_POSITIONS = "explicit_positions"  # only when the layers take RoPE positions from an input
    SAMPLING = "sampling"  # only in graphs with the sampling head (``pagedkv rewrite``'s default)


MODEL_DTYPE = None  # a tensor in the model's own float dtype (float32, float16 or bfloat16)


@dataclass(frozen=True)
class TensorSpec:
    """One engine tensor, or a family of them (``per`` a pool group or a layer: ``name`` has ``{g}`` / ``{i}``)."""

    name: str
    is_input: bool
    dtype: np.dtype | None  # None: MODEL_DTYPE
    shape: tuple[int | str, ...]  # ints are static, strings SYMBOLIC_DIMS
    role: str
    per: Per = Per.ENGINE
    presence: Presence = Presence.ALWAYS

    @property
    def prefix(self) -> str:
        """A family's name up to its index (``block_table_``); an engine tensor's name."""
        return self.name.split("{")[0]

    def named(self, index: int | None = None) -> str:
        """The tensor's name; ``index`` is the pool group / layer of a family."""
        if self.per == Per.ENGINE:
            return self.name
        return self.name.format(**{"g" if self.per == Per.POOL_GROUP else "i": index})


INPUTS = (
    TensorSpec(INPUT_IDS, True, np.dtype(np.int64), (1, NUM_TOKENS), "the step's packed tokens"),
    TensorSpec(KV_POOLS, True, np.dtype(np.int64), (NUM_POOL_GROUPS, step.POOL_DESC_FIELDS),
               "pool descriptors, row g = pool group g: (device address, num_blocks, reserved, reserved); the KV "
               "manager fills it once"),
    TensorSpec(CU_Q_LENS, True, np.dtype(np.int32), (BATCH_PLUS_1,),
               "sequence b owns tokens [cu_q_lens[b], cu_q_lens[b+1]), cu_q_lens[0] = 0"),
    TensorSpec(PAST_LENS, True, np.dtype(np.int32), (BATCH,), "tokens cached before this step"),
    TensorSpec(BLOCK_TABLE, True, np.dtype(np.int32), (BATCH, MAX_BLOCKS),
               "pool group g's physical block of each sequence's page, -1 where none", per=Per.POOL_GROUP),
    TensorSpec(POSITION_IDS, True, np.dtype(np.int32), (NUM_TOKENS,),
               "RoPE position of each token (otherwise past_lens[b] + i)", presence=Presence.EXPLICIT_POSITIONS),
    TensorSpec(LOGITS_ROWS, True, np.dtype(np.int32), (NUM_LOGITS,),
               "the tokens (indices into the step's packed tokens) whose logits are computed: each sequence's "
               "last token when generating, 0..T-1 for every row"),
    TensorSpec(SAMPLING_PARAMS, True, np.dtype(np.float32), (NUM_LOGITS, SAMPLING_FIELDS),
               "per logits row: temperature, top_k, top_p, min_p, repetition, presence and frequency penalties, "
               "the uniform draw u (columns SAMPLING_*)", presence=Presence.SAMPLING),
    TensorSpec(PENALTY_TOKENS, True, np.dtype(np.int32), (NUM_LOGITS, PENALTY_WIDTH),
               "per logits row: the distinct tokens of its prompt and output that penalties apply to, -1 padded",
               presence=Presence.SAMPLING),
    TensorSpec(PENALTY_COUNTS, True, np.dtype(np.float32), (NUM_LOGITS, PENALTY_WIDTH),
               "occurrences of each penalty_tokens entry in the row's output (0 for prompt-only tokens)",
               presence=Presence.SAMPLING),
)
OUTPUTS = (
    TensorSpec(LOGITS, False, MODEL_DTYPE, (1, NUM_LOGITS, VOCAB), "the model's logits of the logits_rows tokens"),
    TensorSpec(NEXT_TOKENS, False, np.dtype(np.int32), (NUM_LOGITS,),
               "the token chosen after each logits row (greedy or sampled by its sampling_params)",
               presence=Presence.SAMPLING),
    TensorSpec(NEXT_LOGPROBS, False, np.dtype(np.float32), (NUM_LOGITS,),
               "log-probability of next_tokens under the model's raw distribution", presence=Presence.SAMPLING),
    TensorSpec(TOP_TOKENS, False, np.dtype(np.int32), (NUM_LOGITS, NUM_TOP_LOGPROBS),
               "the most likely tokens of each row under the raw distribution, best first",
               presence=Presence.SAMPLING),
    TensorSpec(TOP_LOGPROBS, False, np.dtype(np.float32), (NUM_LOGITS, NUM_TOP_LOGPROBS),
               "their log-probabilities", presence=Presence.SAMPLING),
    TensorSpec(KV_WRITE_STATUS, False, np.dtype(np.int32), (step.STATUS_FIELDS,),
               "layer i's write error record, all zero after a clean step (pagedkv.step.raise_for_status)",
               per=Per.LAYER),
)
TENSORS = INPUTS + OUTPUTS
SPECS = {t.name: t for t in TENSORS}
REQUIRED_INPUTS = tuple(t.name for t in INPUTS if t.per == Per.ENGINE and t.presence == Presence.ALWAYS)
_STATUS_RE = re.compile(rf"^{re.escape(SPECS[KV_WRITE_STATUS].prefix)}(\d+)$")


def status_layer(name: str) -> int | None:
    """i for ``kv_write_status_{i}``, else None."""
    m = _STATUS_RE.match(name)
    return int(m.group(1)) if m else None


SAMPLING_INPUTS = tuple(t.name for t in INPUTS if t.presence == Presence.SAMPLING)
SAMPLING_OUTPUTS = tuple(t.name for t in OUTPUTS if t.presence == Presence.SAMPLING)


def _instances(specs, count: int, explicit_positions: bool, sampling: bool):
    present = {Presence.ALWAYS: True, Presence.EXPLICIT_POSITIONS: explicit_positions, Presence.SAMPLING: sampling}
    for spec in specs:
        if not present[spec.presence]:
            continue
        for index in (range(count) if spec.per != Per.ENGINE else [None]):
            yield spec.named(index), spec


def engine_inputs(num_pool_groups: int, explicit_positions: bool, sampling: bool = True) \
        -> list[tuple[str, TensorSpec]]:
    """(name, spec) of every engine input of a graph with these pool groups, in the rewrite's order."""
    return list(_instances(INPUTS, num_pool_groups, explicit_positions, sampling))


def engine_outputs(num_layers: int, sampling: bool = True) -> list[tuple[str, TensorSpec]]:
    """(name, spec) of every engine output of a graph with ``num_layers`` attention layers."""
    return list(_instances(OUTPUTS, num_layers, False, sampling))


def resolve_shape(spec: TensorSpec, dims: dict[str, int]) -> tuple[int | str, ...]:
    """The spec's shape with each symbolic dim found in ``dims`` replaced by its value (the others stay)."""
    return tuple(dims.get(d, d) if isinstance(d, str) else d for d in spec.shape)


def spec_of(name: str) -> tuple[TensorSpec, int | None] | None:
    """(spec, index) of an engine tensor name: ``block_table_3`` -> (BLOCK_TABLE's spec, 3); None when the name is
    not in the contract."""
    if name in SPECS and SPECS[name].per == Per.ENGINE:
        return SPECS[name], None
    for spec in TENSORS:
        if spec.per != Per.ENGINE and name.startswith(spec.prefix) and name[len(spec.prefix):].isdigit():
            return spec, int(name[len(spec.prefix):])
    return None


MODEL_DTYPES = ("float16", "bfloat16", "float32")  # what MODEL_DTYPE may be


def check_engine_io(tensors, profile: dict | None = None) -> list[str]:
    """Problems of an engine's I/O against this contract, each a line naming the tensor; [] when it holds.

    ``tensors``: (name, is_input, dtype name, shape with -1 for dynamic dims) of every engine tensor; ``profile``:
    input name -> (min, opt, max) shapes of one optimization profile. Checked: every tensor is in the contract, in
    the right direction, of its dtype (the MODEL_DTYPE tensors of one float dtype), rank and static dims; the
    required tensors are there (a block table per ``kv_pools`` row, a status per layer, numbered from 0); and each
    profile shape binds every symbolic dim to one value (T, B = batch_plus_1 - 1, MB, G) within min <= opt <= max.
    """
    problems, found, model_dtypes = [], {}, set()
    for name, is_input, dtype, shape in tensors:
        hit = spec_of(name)
        if hit is None:
            problems.append(f"{name}: not an engine tensor of the contract (pagedkv.engine_io)")
            continue
        spec, index = hit
        found.setdefault(spec.name, set()).add(index)
        where = f"{name} ({'input' if is_input else 'output'})"
        if is_input != spec.is_input:
            problems.append(f"{where}: the contract has it as an {'input' if spec.is_input else 'output'}")
        if spec.dtype is None:
            model_dtypes.add(dtype)
            if dtype not in MODEL_DTYPES:
                problems.append(f"{where}: dtype {dtype}, expected the model's float dtype ({'/'.join(MODEL_DTYPES)})")
        elif dtype != spec.dtype.name:
            problems.append(f"{where}: dtype {dtype}, expected {spec.dtype.name}")
        if len(shape) != len(spec.shape):
            problems.append(f"{where}: rank {len(shape)} {list(shape)}, expected {list(spec.shape)}")
            continue
        for axis, (got, want) in enumerate(zip(shape, spec.shape)):
            if isinstance(want, int) and got != want:
                problems.append(f"{where}: dim {axis} is {got}, expected {want}")
    if len(model_dtypes) > 1:
        problems.append(f"model-dtype tensors disagree: {sorted(model_dtypes)}")
    for spec in TENSORS:
        got = found.get(spec.name)
        if spec.per == Per.ENGINE:
            if got is None and spec.presence == Presence.ALWAYS:
                problems.append(f"{spec.name}: missing ({'input' if spec.is_input else 'output'} of every engine)")
        elif got is None or sorted(got) != list(range(len(got))):
            problems.append(f"{spec.name}: the engine has indices {sorted(got or [])}, expected 0..N-1 (N >= 1)")
    groups = {shape[0] for name, _, _, shape in tensors if name == KV_POOLS and shape}
    tables = len(found.get(BLOCK_TABLE, ()))
    if groups and groups != {tables}:
        problems.append(f"{KV_POOLS}: {groups.pop()} pool-group rows but {tables} block tables")
    if profile:
        problems += _check_profile(profile, {n for n, is_input, _, _ in tensors if is_input})
    return problems


def _check_profile(profile: dict, inputs: set[str]) -> list[str]:
    problems = []
    for name in sorted(inputs - set(profile)):
        problems.append(f"{name}: no optimization-profile shapes")
    for k, which in enumerate(("min", "opt", "max")):
        bound: dict[str, set[tuple[int, str]]] = {}
        for name, shapes in profile.items():
            hit = spec_of(name)
            if hit is None or len(shapes[k]) != len(hit[0].shape):
                continue
            for dim, value in zip(hit[0].shape, shapes[k]):
                if isinstance(dim, str):
                    symbol, value = (BATCH, value - 1) if dim == BATCH_PLUS_1 else (dim, value)
                    bound.setdefault(symbol, set()).add((int(value), name))
        for symbol, uses in bound.items():
            if len({v for v, _ in uses}) > 1:
                problems.append(f"profile {which}: {symbol} is bound to different values: "
                                + ", ".join(f"{n}={v}" for v, n in sorted(uses)))
    for name, (lo, opt, hi) in profile.items():
        if not all(a <= b <= c for a, b, c in zip(lo, opt, hi)) or not all(a >= 0 for a in lo):
            problems.append(f"{name}: profile {list(lo)} / {list(opt)} / {list(hi)} is not min <= opt <= max")
    return problems


# ---- for the C++ side and the docs ---------------------------------------------------------------------------
def describe() -> dict:
    """The contract as plain data (what ``--json`` prints)."""
    def tensor(t: TensorSpec) -> dict:
        return {"name": t.name, "dtype": "model" if t.dtype is None else t.dtype.name, "shape": list(t.shape),
                "role": t.role, "per": t.per.value, "presence": t.presence.value}

    return {
        "inputs": [tensor(t) for t in INPUTS],
        "outputs": [tensor(t) for t in OUTPUTS],
        "symbolic_dims": list(SYMBOLIC_DIMS),
        "records": {
            SAMPLING_PARAMS: {"fields": SAMPLING_FIELDS, "columns": dict(SAMPLING_COLUMNS)},
            KV_POOLS: {"fields": step.POOL_DESC_FIELDS,
                       "columns": {"address": step.POOL_DESC_ADDRESS, "num_blocks": step.POOL_DESC_NUM_BLOCKS}},
            "kv_write_status": {
                "fields": step.STATUS_FIELDS,
                "columns": {"flags": step.STATUS_FLAGS, "seq": step.STATUS_SEQ, "page_in_seq": step.STATUS_PAGE_IN_SEQ,
                            "entry": step.STATUS_ENTRY},
                "flags": {"invalid_block": step.STATUS_INVALID_BLOCK, "block_out_of_range": step.STATUS_BLOCK_OUT_OF_RANGE,
                          "past_block_table": step.STATUS_PAST_BLOCK_TABLE}},
        },
    }


def _type_text(t: TensorSpec) -> str:
    return "model float" if t.dtype is None else t.dtype.name.upper()


_PRESENCE_TEXT = {Presence.ALWAYS: "always", Presence.EXPLICIT_POSITIONS: "explicit positions only",
                  Presence.SAMPLING: "sampling head"}


def render_markdown() -> str:
    """The tensor table of ``docs/engine_io.md``."""
    lines = ["| engine tensor | in/out | type | shape | present | meaning |",
             "| --- | --- | --- | --- | --- | --- |"]
    for t in TENSORS:
        present = _PRESENCE_TEXT[t.presence]
        per = {Per.ENGINE: "", Per.POOL_GROUP: ", one per pool group g", Per.LAYER: ", one per layer i"}[t.per]
        shape = "[" + ", ".join(str(d) for d in t.shape) + "]"
        lines.append(f"| `{t.name}` | {'input' if t.is_input else 'output'} | {_type_text(t)} | `{shape}` | "
                     f"{present}{per} | {t.role} |")
    return "\n".join(lines) + "\n"


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


_CPP_DTYPE = {None: "kModelFloat", "int32": "kInt32", "int64": "kInt64", "float32": "kFloat32"}
_CPP_PER = {Per.ENGINE: "kEngine", Per.POOL_GROUP: "kPoolGroup", Per.LAYER: "kLayer"}
_CPP_PRESENCE = {Presence.ALWAYS: "kAlways", Presence.EXPLICIT_POSITIONS: "kExplicitPositions",
                 Presence.SAMPLING: "kSampling"}


def _cpp_dim(d) -> str:
    return f"{{Dim::kStatic, {d}}}" if isinstance(d, int) else f"{{Dim::k{_camel(d)}, 0}}"


def render_header() -> str:
    """``plugins/include/pagedkv/engine_io.h``."""
    max_rank = max(len(t.shape) for t in TENSORS)
    family = {Per.ENGINE: ("", ""), Per.POOL_GROUP: ("Prefix", "  // + pool group g"),
              Per.LAYER: ("Prefix", "  // + layer i")}
    names = "\n".join(f'constexpr char const* k{_camel(t.prefix.rstrip("_"))}{family[t.per][0]} = "{t.prefix}";'
                      f"{family[t.per][1]}" for t in TENSORS)
    dims = "\n".join(f'constexpr char const* kDim{_camel(d)} = "{d}";' for d in SYMBOLIC_DIMS)
    rows = "\n".join(f'    {{"{t.prefix}", {str(t.is_input).lower()}, DType::{_CPP_DTYPE[t.dtype and t.dtype.name]}, '
                     f"Per::{_CPP_PER[t.per]}, Presence::{_CPP_PRESENCE[t.presence]}, {len(t.shape)}, "
                     f"{{{', '.join(_cpp_dim(d) for d in t.shape)}}}}}," for t in TENSORS)
    records = [("kPoolDescFields", step.POOL_DESC_FIELDS), ("kPoolDescAddress", step.POOL_DESC_ADDRESS),
               ("kPoolDescNumBlocks", step.POOL_DESC_NUM_BLOCKS), ("kStatusFields", step.STATUS_FIELDS),
               ("kStatusFlags", step.STATUS_FLAGS), ("kStatusSeq", step.STATUS_SEQ),
               ("kStatusPageInSeq", step.STATUS_PAGE_IN_SEQ), ("kStatusEntry", step.STATUS_ENTRY),
               ("kStatusInvalidBlock", step.STATUS_INVALID_BLOCK),
               ("kStatusBlockOutOfRange", step.STATUS_BLOCK_OUT_OF_RANGE),
               ("kStatusPastBlockTable", step.STATUS_PAST_BLOCK_TABLE)]
    asserts = "\n".join(f'static_assert({name} == {value}, "pagedkv.step disagrees with step_metadata.h on {name}");'
                        for name, value in records)
    dim_enum = ", ".join(f"k{_camel(d)}" for d in SYMBOLIC_DIMS)
    sampling = "\n".join(f"constexpr int32_t kSampling{_camel(name)} = {column};"
                         for name, column in SAMPLING_COLUMNS.items())
    return f"""\
// GENERATED by `python -m pagedkv.engine_io --header` from src/pagedkv/engine_io.py: do not edit.
// tests/test_engine_io.py regenerates it and fails on any difference.
//
// The rewritten graph's engine inputs and outputs (docs/engine_io.md): what a runtime binds by name and
// checks an engine's I/O against. The records inside kv_pools and kv_write_status_{{i}} are step_metadata.h's.
#pragma once

#include <cstdint>

#include "pagedkv/step_metadata.h"

namespace pagedkv {{
namespace engine_io {{

// Tensor names; a family (one per pool group g / layer i) is its prefix followed by the decimal index.
{names}

// Symbolic dims, as the rewritten ONNX graph names them.
{dims}

enum class DType : int32_t {{ kInt32, kInt64, kModelFloat /* the model's own: float32, float16 or bfloat16 */, kFloat32 }};
enum class Per : int32_t {{ kEngine, kPoolGroup, kLayer }};
enum class Presence : int32_t {{ kAlways, kExplicitPositions, kSampling }};
enum class Dim : int32_t {{ kStatic, {dim_enum} }};

struct DimSpec {{
    Dim dim;
    int32_t value;  // the size when dim == Dim::kStatic
}};

struct TensorSpec {{
    char const* name;  // the name, or the family's prefix (per != Per::kEngine)
    bool isInput;
    DType dtype;
    Per per;
    Presence presence;
    int32_t rank;
    DimSpec shape[{max_rank}];
}};

constexpr TensorSpec kTensors[] = {{
{rows}
}};
constexpr int32_t kNumTensors = {len(TENSORS)};

// Columns of the sampling_params record (FLOAT32 [num_logits, kSamplingFields]).
{sampling}
constexpr int32_t kSamplingFields = {SAMPLING_FIELDS};

}}  // namespace engine_io

// The Python twin of the records (pagedkv.step) against the C++ enums, at compile time.
{asserts}

}}  // namespace pagedkv
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.engine_io", description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--json", action="store_true", help="the contract as JSON")
    what.add_argument("--header", action="store_true", help="the generated C++ header")
    what.add_argument("--markdown", action="store_true", help="the tensor table of docs/engine_io.md")
    args = parser.parse_args(argv)
    if args.json:
        text = json.dumps(describe(), indent=2) + "\n"
    elif args.header:
        text = render_header()
    else:
        text = render_markdown()
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
