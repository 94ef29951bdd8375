"""Both plugins enqueued on a GPU through the test host, against the float64 numpy references.

``pagedkv_testhost enqueue`` runs each plugin as an engine would (build-phase plugin -> fields -> runtime-phase
plugin -> attachToContext -> onShapeChange -> enqueue) on real device buffers and dumps what it wrote. The pool
is a device allocation the plugins only see through ``kv_pools`` (a pointer), surrounded here by guard zones
and, with ``pool_index`` = 1, preceded by a decoy pool: both must come back untouched. Outputs and the
workspace start poisoned (0xFF: NaN for fp16/bf16, -1 for int32).

References: ``pagedkv.reference.qkv_write`` (pool + q), ``pagedkv.reference.paged_attention``; and for the
chained write -> attention run, ``pagedkv.reference.dense_attention`` over K/V built without any paging.
Tolerances: ``conftest.TOLERANCES``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import zlib

import ml_dtypes
import numpy as np
import pytest
from conftest import TOLERANCES

from pagedkv import _lib
from pagedkv.config import (ATTENTION_PLUGIN_NAME, WRITE_PLUGIN_NAME, AttentionConfig, PoolConfig, RopeConfig,
                            RopeScaling, RopeStyle, WriteConfig)
from pagedkv.kernels.write import IODType
from pagedkv.layout import INVALID_BLOCK, CacheDType, PageLayout
from pagedkv.reference import apply_rope, dense_attention, dequantize, paged_attention, qkv_write, quantize
from pagedkv.step import (POOL_DESC_FIELDS, STATUS_FIELDS, STATUS_INVALID_BLOCK, KVWriteError, StepMetadata,
                          raise_for_status)

pytestmark = pytest.mark.gpu

GUARD_BYTES = 4096
GUARD_BYTE = 0xA5
HOST_TIMEOUT_S = 300

TRT_TYPES = {np.dtype(np.float16): "kHALF", np.dtype(ml_dtypes.bfloat16): "kBF16",
             np.dtype(ml_dtypes.float8_e4m3fn): "kFP8", np.dtype(np.int32): "kINT32", np.dtype(np.int64): "kINT64"}
NUMPY_TYPES = {v: k for k, v in TRT_TYPES.items()}
IO_DTYPES = {"fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}


@pytest.fixture(scope="module")
def host():
    exe = _lib.find_file(_lib.TESTHOST_NAME)
    lib = _lib.find_file(_lib.PLUGINS_NAME)
    if exe is None or lib is None:
        pytest.fail(f"{_lib.TESTHOST_NAME} / {_lib.PLUGINS_NAME} not found in {[str(d) for d in _lib.lib_dirs()]}")
    return str(exe), str(lib)


# ================================================================================================ plans
class Plan:
    """An enqueue plan: named device tensors and buffers, plugin steps, and what to dump afterwards."""

    def __init__(self, tmp_path):
        self.dir = tmp_path
        self.tensors, self.buffers, self.steps, self.dump = {}, {}, [], []

    def tensor(self, name, array, addresses=()):
        array = np.ascontiguousarray(array)
        (self.dir / f"in_{name}.bin").write_bytes(array.tobytes())
        self.tensors[name] = {"type": TRT_TYPES[array.dtype], "dims": list(array.shape), "file": f"in_{name}.bin"}
        if addresses:
            self.tensors[name]["addresses"] = list(addresses)

    def buffer(self, name, raw: bytes):
        (self.dir / f"buf_{name}.bin").write_bytes(raw)
        self.buffers[name] = {"file": f"buf_{name}.bin"}
        self.dump.append(name)

    def step(self, plugin, cfg, inputs, outputs):
        self.steps.append({"plugin": plugin, "attrs": cfg.to_attributes(), "inputs": list(inputs),
                           "outputs": list(outputs)})
        self.dump += [o for o in outputs if o not in self.dump]

    def run(self, host):
        exe, lib = host
        out_dir = self.dir / "out"
        out_dir.mkdir(exist_ok=True)
        plan = {"buffers": self.buffers, "tensors": self.tensors, "steps": self.steps, "dump": self.dump}
        (self.dir / "plan.json").write_text(json.dumps(plan))
        proc = subprocess.run([exe, "enqueue", "--lib", lib, "--plan", str(self.dir / "plan.json"), "--out",
                               str(out_dir)], capture_output=True, text=True, timeout=HOST_TIMEOUT_S)
        if proc.returncode < 0:
            pytest.fail(f"the plugin library crashed the test host (signal {-proc.returncode}): {proc.stderr}")
        assert proc.returncode in (0, 1), proc.stderr
        report = json.loads(proc.stdout)
        manifest = json.loads((out_dir / "manifest.json").read_text())
        dumped = {}
        for name, entry in manifest.items():
            raw = (out_dir / entry["file"]).read_bytes()
            if "type" in entry:
                dumped[name] = np.frombuffer(raw, dtype=NUMPY_TYPES[entry["type"]]).reshape(entry["dims"])
            else:
                dumped[name] = np.frombuffer(raw, dtype=np.uint8)
        return report, dumped


def assert_steps_ok(report):
    for step in report["steps"]:
        assert step["ok"], step
        assert not [m for m in step["messages"] if m["severity"] in ("ERROR", "INTERNAL_ERROR")], step["messages"]
    assert report["ok"]


# ================================================================================================ pools
def poison(cache_dtype: CacheDType) -> np.ndarray:
    """One stored element no write produces: NaN for float caches; int8 has no NaN, so -127, which the int8
    cases' scales keep out of reach (|x / scale| stays far below 127)."""
    return {CacheDType.FP16: np.array([np.nan], np.float16), CacheDType.BF16: np.array([np.nan], ml_dtypes.bfloat16),
            CacheDType.FP8_E4M3: np.array([np.nan], ml_dtypes.float8_e4m3fn),
            CacheDType.INT8: np.array([-127], np.int8)}[cache_dtype]


def new_pool(pool_cfg: PoolConfig, num_blocks: int) -> np.ndarray:
    layout = pool_cfg.layout()
    dtype = CacheDType(pool_cfg.cache_dtype)
    return np.full(layout.pool_shape(num_blocks), poison(dtype)[0], dtype=dtype.numpy_dtype)


def add_pools(plan: Plan, pool_cfg: PoolConfig, pool: np.ndarray, decoy_seed=7):
    """Device pools with guard zones; kv_pools row pool_index points at `pool`, other rows at decoys."""
    guard = bytes([GUARD_BYTE]) * GUARD_BYTES
    rows = []
    for g in range(pool_cfg.pool_index + 1):
        if g == pool_cfg.pool_index:
            plan.buffer(f"pool{g}", guard + pool.tobytes() + guard)
        else:
            decoy = np.random.default_rng(decoy_seed + g).integers(0, 256, pool.nbytes, dtype=np.uint8)
            plan.buffer(f"pool{g}", guard + decoy.tobytes() + guard)
        rows.append([0, pool.shape[0], 0, 0])
    descs = np.array(rows, dtype=np.int64).reshape(-1, POOL_DESC_FIELDS)
    plan.tensor("kv_pools", descs, addresses=[{"element": g * POOL_DESC_FIELDS + 0, "buffer": f"pool{g}",
                                               "offset": GUARD_BYTES} for g in range(len(rows))])


def pool_from_dump(dumped, plan: Plan, pool_cfg: PoolConfig, like: np.ndarray) -> np.ndarray:
    """The device pool after the run; its guards and every decoy pool must be byte-identical to before."""
    for g in range(pool_cfg.pool_index + 1):
        raw = dumped[f"pool{g}"]
        before = np.frombuffer((plan.dir / f"buf_pool{g}.bin").read_bytes(), dtype=np.uint8)
        assert np.array_equal(raw[:GUARD_BYTES], before[:GUARD_BYTES]), "write before the pool"
        assert np.array_equal(raw[-GUARD_BYTES:], before[-GUARD_BYTES:]), "write after the pool"
        if g != pool_cfg.pool_index:
            assert np.array_equal(raw, before), f"decoy pool {g} was written: pool_index not honoured"
    raw = dumped[f"pool{pool_cfg.pool_index}"][GUARD_BYTES:-GUARD_BYTES]
    return raw.view(like.dtype).reshape(like.shape)


FP8_MIN_NORMAL = 2.0 ** -6  # e4m3: the relative bound of TOLERANCES holds for normal numbers
FP8_SUBNORMAL_HALF_STEP = 2.0 ** -10  # e4m3 subnormals are multiples of 2**-9 (in units of the scale)
INT8_TIE_BAND = 1e-4  # |x / scale| this close to k + 1/2: fp32 (kernel) and float64 may round either way


def assert_stored_close(got_stored, exact, cache: CacheDType, scale: float, what: str):
    """Stored values against the exact (float64) values they quantize, with conftest.TOLERANCES."""
    deq = dequantize(got_stored, cache, scale)
    atol, rtol = TOLERANCES[np.dtype(cache.numpy_dtype).name]
    if cache == CacheDType.INT8:  # in units of the scale; a near-tie may round the other way in fp32
        units = exact / scale
        tie = np.abs(np.abs(units) % 1.0 - 0.5) < INT8_TIE_BAND
        np.testing.assert_allclose(deq[~tie] / scale, units[~tie], atol=atol, rtol=rtol, err_msg=what)
        assert np.all(np.abs(deq[tie] / scale - units[tie]) <= 0.5 + INT8_TIE_BAND), what
    elif cache == CacheDType.FP8_E4M3:
        normal = np.abs(exact / scale) >= FP8_MIN_NORMAL
        np.testing.assert_allclose(deq[normal], exact[normal], atol=atol, rtol=rtol, err_msg=what)
        assert np.all(np.abs(deq[~normal] - exact[~normal]) <= FP8_SUBNORMAL_HALF_STEP * scale * (1 + 1e-6)), what
    else:
        np.testing.assert_allclose(deq, exact, atol=atol, rtol=rtol, err_msg=what)


def exact_qkv(cfg: WriteConfig, qkv, bias, positions, kv_lens=None):
    """float64 q, k (bias + RoPE) and v (bias) of each token [T, heads, D]: the values before any storage.
    ``kv_lens`` [T]: each token's sequence's kv length after the step (LongRoPE picks its table by it)."""
    h, kvh, d = cfg.num_q_heads, cfg.pool.num_kv_heads, cfg.pool.head_dim
    x = qkv.astype(np.float64) + (0.0 if bias is None else bias.astype(np.float64))
    x = x.reshape(-1, h + 2 * kvh, d)
    q = apply_rope(x[:, :h], positions, d, cfg.rope, kv_lens)
    k = apply_rope(x[:, h:h + kvh], positions, d, cfg.rope, kv_lens)
    return q, k, x[:, h + kvh:]


def token_rows(pool_cfg: PoolConfig, meta: StepMetadata, num_blocks: int) -> np.ndarray:
    """[T, KVH] rows (of D elements) where each token's K row of each head lives; V rows are + stride_kv / D.
    Through the layout contract (KVLayout.locate, elem_offset), as the kernels address the pool."""
    layout = pool_cfg.layout()
    rows = np.empty((meta.num_tokens, layout.num_kv_heads), np.int64)
    heads = np.arange(layout.num_kv_heads)[None, :]
    for seq in range(meta.num_seqs):
        t = np.arange(meta.cu_q_lens[seq], meta.cu_q_lens[seq + 1])
        block, offset, _ = layout.locate(meta.block_table[seq], meta.past_lens[seq] + np.arange(t.size), num_blocks)
        assert np.all(block != INVALID_BLOCK), "test setup: every token must have a page"
        elem = layout.elem_offset(block[:, None], pool_cfg.layer_index, 0, heads, offset[:, None])
        rows[t] = elem // layout.head_dim
    return rows


def assert_pool_matches(got, expected, pool_cfg: PoolConfig, meta: StepMetadata, k_exact, v_exact):
    """Each token's K and V rows hold its exact values within one rounding of the cache dtype; every other
    element (untouched poison, earlier tokens, zeroed V tails) is bit-identical to the reference's pool."""
    layout = pool_cfg.layout()
    d = layout.head_dim
    cache = CacheDType(pool_cfg.cache_dtype)
    k_rows = token_rows(pool_cfg, meta, got.shape[0])
    v_rows = k_rows + layout.stride_kv // d
    got_rows, expected_rows = got.reshape(-1, d), expected.reshape(-1, d)
    assert_stored_close(got_rows[k_rows], k_exact, cache, pool_cfg.k_scale, "K")
    assert_stored_close(got_rows[v_rows], v_exact, cache, pool_cfg.v_scale, "V")
    bits = {1: np.uint8, 2: np.uint16}[got.dtype.itemsize]
    others = np.ones(got_rows.shape[0], bool)
    others[k_rows.ravel()] = False
    others[v_rows.ravel()] = False
    same = got_rows[others].view(bits) == expected_rows[others].view(bits)
    assert same.all(), f"{(~same).sum()} pool elements outside this step's token rows differ from the reference"
    assert (expected_rows[~others].view(bits) != 0).any(), "the case wrote nothing"


# ================================================================================================ steps
@dataclasses.dataclass(frozen=True)
class Batch:
    """One step of a mixed batch: per sequence, tokens cached before and new tokens now."""

    past: tuple[int, ...]
    new: tuple[int, ...]

    def __post_init__(self):
        assert len(self.past) == len(self.new)


def block_table_for(pool_cfg: PoolConfig, lengths, rng, spare_columns=1, spare_blocks=3):
    """Distinct physical blocks in shuffled order, enough for each sequence's final length; -1 beyond."""
    layout = pool_cfg.layout()
    pages = [int(layout.pages_needed(n)) for n in lengths]
    num_blocks = sum(pages) + spare_blocks
    ids = rng.permutation(num_blocks)
    table = np.full((len(lengths), max(pages) + spare_columns), INVALID_BLOCK, dtype=np.int32)
    at = 0
    for s, n in enumerate(pages):
        table[s, :n] = ids[at:at + n]
        at += n
    return table, num_blocks


def meta_for(batch: Batch, table, position_base=None, rng=None) -> StepMetadata:
    cu = np.concatenate([[0], np.cumsum(batch.new)]).astype(np.int32)
    positions = None
    if position_base is not None:  # explicit RoPE positions (e.g. M-RoPE text offsets): not past + i
        positions = np.concatenate([position_base + np.arange(p, p + n) for p, n in zip(batch.past, batch.new)])
        positions = (positions + rng.integers(0, 3, positions.size)).astype(np.int32)
    return StepMetadata(block_table=table, cu_q_lens=cu, past_lens=np.array(batch.past, np.int32),
                        position_ids=positions)


def write_step_tensors(plan: Plan, prefix: str, cfg: WriteConfig, meta: StepMetadata, qkv, bias):
    plan.tensor(f"{prefix}qkv", qkv)
    plan.tensor(f"{prefix}cu_q_lens", meta.cu_q_lens)
    plan.tensor(f"{prefix}past_lens", meta.past_lens)
    inputs = [f"{prefix}qkv", "kv_pools", "block_table", f"{prefix}cu_q_lens", f"{prefix}past_lens"]
    if cfg.explicit_positions:
        plan.tensor(f"{prefix}position_ids", meta.position_ids)
        inputs.append(f"{prefix}position_ids")
    if cfg.has_bias:
        plan.tensor(f"{prefix}bias", bias)
        inputs.append(f"{prefix}bias")
    return inputs


def random_qkv(cfg: WriteConfig, num_tokens: int, io, rng):
    width = (cfg.num_q_heads + 2 * cfg.pool.num_kv_heads) * cfg.pool.head_dim
    qkv = rng.standard_normal((num_tokens, width)).astype(io)
    bias = (0.5 * rng.standard_normal(width)).astype(io) if cfg.has_bias else None
    return qkv, bias


# ================================================================================================ write
@dataclasses.dataclass(frozen=True)
class WriteCase:
    id: str
    cfg: WriteConfig
    io: str
    prefix: Batch  # written by the reference first (the cache before this step)
    step: Batch    # written by the plugin and the reference

    def __post_init__(self):
        assert self.prefix.new == self.step.past


def wcfg(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, **kw):
    pool_kw = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in dataclasses.fields(PoolConfig)}}
    pool = PoolConfig(num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, num_layers=3,
                      layer_index=1, **pool_kw)
    return WriteConfig(num_q_heads=num_q_heads, pool=pool, **kw)


MIXED = Batch(past=(0, 37, 16, 5), new=(37, 1, 3, 20))  # prefill chunk, decode, draft tokens, chunk continuation
WRITE_CASES = [
    WriteCase("fp16-d64-mixed", wcfg(), "fp16", Batch((0,) * 4, (0, 37, 16, 5)), MIXED),
    WriteCase("bf16-d128-nhd-bias-positions",
              wcfg(num_q_heads=8, head_dim=128, page_layout=PageLayout.NHD, has_bias=True, explicit_positions=True),
              "bf16", Batch((0,) * 4, (0, 37, 16, 5)), MIXED),
    WriteCase("fp16-d256-mha-gptj-odd-page",
              wcfg(num_q_heads=2, num_kv_heads=2, head_dim=256, page_size=13, rope=RopeConfig(
                  style=RopeStyle.GPTJ, rotary_dim=128, theta=500000.0, scaling=RopeScaling.LLAMA3, factor=8.0)),
              "fp16", Batch((0, 0), (12, 0)), Batch((12, 0), (3, 29))),
    WriteCase("bf16-fp8cache-fp8q-pool1",
              wcfg(cache_dtype=CacheDType.FP8_E4M3, k_scale=0.05, v_scale=0.04, pool_index=1, q_out_fp8=True,
                   q_scale=0.03), "bf16", Batch((0,) * 4, (0, 37, 16, 5)), MIXED),
    WriteCase("fp16-int8cache-linear-rope", wcfg(cache_dtype=CacheDType.INT8, k_scale=0.1, v_scale=0.08,
                                                 rope=RopeConfig(scaling=RopeScaling.LINEAR, factor=4.0)),
              "fp16", Batch((0,) * 4, (0, 37, 16, 5)), MIXED),
    # Ring of 32 slots after 3 sinks + a 5-slot bubble: sequence 0's step wraps onto positions 3.. (overwrite).
    WriteCase("fp16-cyclic-sinks", wcfg(page_size=8, ring_sink_tokens=3, cyclic_len=32, rope=RopeConfig(rotary_dim=32)),
              "fp16", Batch((0, 0), (30, 2)), Batch((30, 2), (8, 6))),
    WriteCase("fp16-no-rope-no-tail", wcfg(rope=RopeConfig(style=RopeStyle.NONE), zero_v_tail=False), "fp16",
              Batch((0, 0), (5, 0)), Batch((5, 0), (9, 17))),
    # head dims 80 (Phi-2: partial rotary 32 of 80, bias) and 96 (Phi-3-mini: full rotary, fp8 cache, NHD)
    WriteCase("fp16-d80-phi2-partial-bias", wcfg(num_q_heads=4, num_kv_heads=4, head_dim=80, has_bias=True,
                                                 rope=RopeConfig(rotary_dim=32)),
              "fp16", Batch((0,) * 4, (0, 37, 16, 5)), MIXED),
    WriteCase("bf16-d96-fp8cache-nhd", wcfg(num_q_heads=6, num_kv_heads=2, head_dim=96, page_layout=PageLayout.NHD,
                                            cache_dtype=CacheDType.FP8_E4M3, k_scale=0.05, v_scale=0.04),
              "bf16", Batch((0,) * 4, (0, 37, 16, 5)), MIXED),
    # the scalings' plugin fields through to the kernel at 80 / 96: YaRN on partial rotary; Phi-3-mini's LongRoPE
    # switching past kv length 30, so MIXED's sequences (kv lengths 37, 38, 19, 25) take both tables in one launch
    WriteCase("bf16-d80-yarn-partial-bias", wcfg(num_q_heads=4, num_kv_heads=2, head_dim=80, has_bias=True,
                                                 rope=RopeConfig(rotary_dim=48, scaling=RopeScaling.YARN, factor=4.0,
                                                                 original_max_positions=64)),
              "bf16", Batch((0,) * 4, (0, 37, 16, 5)), MIXED),
    WriteCase("fp16-d96-longrope-phi3", wcfg(num_q_heads=6, num_kv_heads=2, head_dim=96, rope=RopeConfig(
        scaling=RopeScaling.LONGROPE, original_max_positions=30, factor=16.0,
        short_factors=tuple(1.0 + 0.02 * i for i in range(48)), long_factors=tuple(1.5 + 0.5 * i for i in range(48)))),
              "fp16", Batch((0,) * 4, (0, 37, 16, 5)), MIXED),
]


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: c.id)
def test_write_plugin_matches_reference(host, tmp_path, case):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    cfg, io = case.cfg, IO_DTYPES[case.io]
    final = [p + n for p, n in zip(case.step.past, case.step.new)]
    table, num_blocks = block_table_for(cfg.pool, final, rng)
    pool = new_pool(cfg.pool, num_blocks)
    base = 1000 if cfg.explicit_positions else None
    # The cache before the step: the reference writes the prefix (other engineers test that path on its own).
    prefix_meta = meta_for(case.prefix, table, base, rng)
    prefix_qkv, prefix_bias = random_qkv(cfg, prefix_meta.num_tokens, io, rng)
    qkv_write(prefix_qkv, prefix_bias, prefix_meta, pool, cfg)
    before = pool.copy()

    meta = meta_for(case.step, table, base, rng)
    qkv, bias = random_qkv(cfg, meta.num_tokens, io, rng)
    expected_pool = before.copy()
    qkv_write(qkv, bias, meta, expected_pool, cfg)  # the pool outside the token rows (tails, neighbours)
    q_exact, k_exact, v_exact = exact_qkv(cfg, qkv, bias, meta.rope_positions, meta.kv_lens[meta.token_seq])

    plan = Plan(tmp_path)
    add_pools(plan, cfg.pool, before)
    plan.tensor("block_table", table)
    inputs = write_step_tensors(plan, "", cfg, meta, qkv, bias)
    plan.step(WRITE_PLUGIN_NAME, cfg, inputs, ["q", "status"])
    report, dumped = plan.run(host)
    assert_steps_ok(report)

    assert dumped["status"].tolist() == [0] * STATUS_FIELDS
    q = dumped["q"].reshape(meta.num_tokens, cfg.num_q_heads, cfg.pool.head_dim)
    if cfg.q_out_fp8:
        assert_stored_close(q, q_exact, CacheDType.FP8_E4M3, cfg.q_scale, "q")
    else:
        atol, rtol = TOLERANCES[io.name]
        np.testing.assert_allclose(q.astype(np.float64), q_exact, atol=atol, rtol=rtol)
    got = pool_from_dump(dumped, plan, cfg.pool, before)
    assert_pool_matches(got, expected_pool, cfg.pool, meta, k_exact, v_exact)


def test_write_plugin_reports_an_invalid_page(host, tmp_path):
    """A live token whose page is -1: kv_write_status names it, raise_for_status raises, nothing lands outside
    the pool. Sequence 1 loses its second page."""
    rng = np.random.default_rng(11)
    cfg = wcfg()
    step = Batch((0, 0), (5, 20))
    table, num_blocks = block_table_for(cfg.pool, [5, 20], rng)
    table[1, 1] = INVALID_BLOCK
    pool = new_pool(cfg.pool, num_blocks)
    meta = meta_for(step, table)
    qkv, _ = random_qkv(cfg, meta.num_tokens, np.float16, rng)

    plan = Plan(tmp_path)
    add_pools(plan, cfg.pool, pool)
    plan.tensor("block_table", table)
    plan.step(WRITE_PLUGIN_NAME, cfg, write_step_tensors(plan, "", cfg, meta, qkv, None), ["q", "status"])
    report, dumped = plan.run(host)
    assert_steps_ok(report)  # the engine step itself succeeds: the error travels in kv_write_status
    status = dumped["status"]
    assert status[0] & STATUS_INVALID_BLOCK and status[1:].tolist() == [1, 1, INVALID_BLOCK]
    with pytest.raises(KVWriteError, match=r"block_table\[1\]\[1\] = -1"):
        raise_for_status(status)
    pool_from_dump(dumped, plan, cfg.pool, pool)  # guards intact


def test_empty_step_still_clears_the_status(host, tmp_path):
    """T = 0: nothing to write, but kv_write_status (poisoned to -1 by the host) must read clean."""
    cfg = wcfg()
    table = np.zeros((1, 1), np.int32)
    pool = new_pool(cfg.pool, 1)
    meta = StepMetadata(block_table=table, cu_q_lens=np.zeros(2, np.int32), past_lens=np.zeros(1, np.int32))
    plan = Plan(tmp_path)
    add_pools(plan, cfg.pool, pool)
    plan.tensor("block_table", table)
    qkv = np.zeros((0, (cfg.num_q_heads + 2 * cfg.pool.num_kv_heads) * cfg.pool.head_dim), np.float16)
    plan.step(WRITE_PLUGIN_NAME, cfg, write_step_tensors(plan, "", cfg, meta, qkv, None), ["q", "status"])
    report, dumped = plan.run(host)
    assert_steps_ok(report)
    assert dumped["status"].tolist() == [0] * STATUS_FIELDS
    assert np.array_equal(pool_from_dump(dumped, plan, cfg.pool, pool).view(np.uint16), pool.view(np.uint16))


# ================================================================================================ attention
def acfg(write: WriteConfig, **kw) -> AttentionConfig:
    return AttentionConfig(num_q_heads=write.num_q_heads, pool=write.pool, **kw)


ATTENTION_CASES = [
    ("fp16-d64-mixed", wcfg(), "fp16", {}),
    ("bf16-d128-gqa4-nhd", wcfg(num_q_heads=8, head_dim=128, page_layout=PageLayout.NHD,
                                cache_dtype=CacheDType.BF16), "bf16", {}),
    ("fp16-window-sinks-softcap", wcfg(page_size=8), "fp16", dict(window=9, attention_sinks=2, logit_softcap=5.0,
                                                                  softmax_scale=0.2)),
    ("bf16-fp8cache-d256", wcfg(num_q_heads=2, num_kv_heads=1, head_dim=256, cache_dtype=CacheDType.FP8_E4M3,
                                k_scale=0.05, v_scale=0.04, pool_index=1), "bf16", {}),
    ("fp16-int8cache", wcfg(cache_dtype=CacheDType.INT8, k_scale=0.1, v_scale=0.08), "fp16", {}),
    ("fp16-d80-window-softcap", wcfg(head_dim=80, page_size=8), "fp16", dict(window=9, attention_sinks=2,
                                                                             logit_softcap=5.0)),
    ("bf16-d96-gqa3-nhd", wcfg(num_q_heads=6, num_kv_heads=2, head_dim=96, page_layout=PageLayout.NHD,
                               cache_dtype=CacheDType.BF16), "bf16", {}),
    ("bf16-int8cache-d96", wcfg(num_q_heads=6, num_kv_heads=2, head_dim=96, cache_dtype=CacheDType.INT8,
                                k_scale=0.1, v_scale=0.08), "bf16", {}),
]


@pytest.mark.parametrize("case_id,write,io_name,extra", ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES])
def test_attention_plugin_matches_reference(host, tmp_path, case_id, write, io_name, extra):
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    io = IO_DTYPES[io_name]
    cfg = acfg(write, **extra)
    step = MIXED
    final = [p + n for p, n in zip(step.past, step.new)]
    table, num_blocks = block_table_for(write.pool, final, rng)
    pool = new_pool(write.pool, num_blocks)
    # The cache: every position up to past + new written by the reference (this step's K/V included).
    full = Batch(past=(0,) * len(final), new=tuple(final))
    full_qkv, _ = random_qkv(write, sum(final), io, rng)
    qkv_write(full_qkv, None, meta_for(full, table), pool, write)
    meta = meta_for(step, table)
    q = (rng.standard_normal((meta.num_tokens, cfg.num_q_heads * cfg.pool.head_dim))).astype(io)
    expected = paged_attention(q, meta, pool, cfg)

    plan = Plan(tmp_path)
    add_pools(plan, cfg.pool, pool)
    plan.tensor("block_table", table)
    plan.tensor("q", q)
    plan.tensor("cu_q_lens", meta.cu_q_lens)
    plan.tensor("past_lens", meta.past_lens)
    plan.tensor("kv_write_status", np.zeros(STATUS_FIELDS, np.int32))
    plan.step(ATTENTION_PLUGIN_NAME, cfg, ["q", "kv_pools", "block_table", "cu_q_lens", "past_lens",
                                           "kv_write_status"], ["out"])
    report, dumped = plan.run(host)
    assert_steps_ok(report)
    out = dumped["out"].astype(np.float64).reshape(expected.shape)
    atol, rtol = TOLERANCES[io.name]
    np.testing.assert_allclose(out, expected, atol=atol, rtol=rtol)
    got = pool_from_dump(dumped, plan, cfg.pool, pool)
    assert np.array_equal(got.view(np.uint8), pool.view(np.uint8)), "attention must not write the pool"


# ================================================================================================ chained
CHAIN_CASES = [
    ("fp16", wcfg(has_bias=True), "fp16", False),
    ("bf16-gqa4-d128", wcfg(num_q_heads=8, head_dim=128, page_size=32, cache_dtype=CacheDType.BF16), "bf16", False),
    ("fp16-fp8q-fp8cache", wcfg(cache_dtype=CacheDType.FP8_E4M3, k_scale=0.05, v_scale=0.05, q_out_fp8=True,
                                q_scale=0.03), "fp16", True),
    ("bf16-fp8q-fp8cache", wcfg(cache_dtype=CacheDType.FP8_E4M3, k_scale=0.05, v_scale=0.05, q_out_fp8=True,
                                q_scale=0.03), "bf16", True),
    ("fp16-d80-phi2", wcfg(num_q_heads=4, num_kv_heads=4, head_dim=80, has_bias=True, cache_dtype=CacheDType.FP16,
                           rope=RopeConfig(rotary_dim=32)), "fp16", False),
    ("bf16-d96-phi3", wcfg(num_q_heads=6, num_kv_heads=2, head_dim=96, page_size=32, cache_dtype=CacheDType.BF16),
     "bf16", False),
    ("fp16-d96-fp8q-fp8cache", wcfg(num_q_heads=6, num_kv_heads=2, head_dim=96, cache_dtype=CacheDType.FP8_E4M3,
                                    k_scale=0.05, v_scale=0.05, q_out_fp8=True, q_scale=0.03), "fp16", True),
]


@pytest.mark.parametrize("case_id,write,io_name,fp8_q", CHAIN_CASES, ids=[c[0] for c in CHAIN_CASES])
def test_write_then_attention_equals_dense_attention(host, tmp_path, case_id, write, io_name, fp8_q):
    """Two engine steps in one process sharing the pool: a prefill chunk (write), then a mixed step (write +
    attention). The attention output equals dense attention over K/V built with no paging at all."""
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    io = IO_DTYPES[io_name]
    # an fp8 q says nothing about the model's dtype: the node names the output's (the activations')
    attn = acfg(write, q_fp8=fp8_q, q_scale=write.q_scale, out_dtype=int(IODType.from_numpy(io)) if fp8_q else -1)
    first, second = Batch((0,) * 4, (0, 37, 16, 5)), MIXED
    final = [p + n for p, n in zip(second.past, second.new)]
    table, num_blocks = block_table_for(write.pool, final, rng)
    pool = new_pool(write.pool, num_blocks)
    meta1, meta2 = meta_for(first, table), meta_for(second, table)
    qkv1, bias = random_qkv(write, meta1.num_tokens, io, rng)
    qkv2, _ = random_qkv(write, meta2.num_tokens, io, rng)

    plan = Plan(tmp_path)
    add_pools(plan, write.pool, pool)
    plan.tensor("block_table", table)
    plan.step(WRITE_PLUGIN_NAME, write, write_step_tensors(plan, "s1_", write, meta1, qkv1, bias),
              ["s1_q", "s1_status"])
    inputs2 = write_step_tensors(plan, "s2_", write, meta2, qkv2, bias)
    plan.step(WRITE_PLUGIN_NAME, write, inputs2, ["s2_q", "s2_status"])
    plan.step(ATTENTION_PLUGIN_NAME, attn, ["s2_q", "kv_pools", "block_table", "s2_cu_q_lens", "s2_past_lens",
                                            "s2_status"], ["out"])
    report, dumped = plan.run(host)
    assert_steps_ok(report)
    assert dumped["s1_status"].tolist() == [0] * 4 and dumped["s2_status"].tolist() == [0] * 4

    # Dense K/V per sequence: both chunks' tokens in cache order, bias + RoPE + storage rounding, no pages.
    h, d = write.num_q_heads, write.pool.head_dim
    cache = CacheDType(write.pool.cache_dtype)
    q2 = dumped["s2_q"]
    q2 = (dequantize(q2, CacheDType.FP8_E4M3, write.q_scale) if fp8_q else q2.astype(np.float64))
    q2 = q2.reshape(meta2.num_tokens, h, d)
    expected = np.empty_like(q2)
    for s in range(len(final)):
        rows1 = np.arange(meta1.cu_q_lens[s], meta1.cu_q_lens[s + 1])
        rows2 = np.arange(meta2.cu_q_lens[s], meta2.cu_q_lens[s + 1])
        pos = np.arange(rows1.size + rows2.size)
        _, k, v = exact_qkv(write, np.concatenate([qkv1[rows1], qkv2[rows2]]), bias, pos)
        k = dequantize(quantize(k, cache, write.pool.k_scale), cache, write.pool.k_scale)
        v = dequantize(quantize(v, cache, write.pool.v_scale), cache, write.pool.v_scale)
        q_pos = second.past[s] + np.arange(rows2.size)
        expected[rows2] = dense_attention(q2[rows2], k, v, q_pos, pos, softmax_scale=attn.resolved_softmax_scale)
    if cache.quantized:
        # A quantized cache may round a K/V element one step apart from float64 RoPE + quantize; compare with
        # the paged reference over the pool the write plugin produced (checked on its own above).
        got_pool = pool_from_dump(dumped, plan, write.pool, pool)
        expected = paged_attention(dumped["s2_q"], meta2, got_pool, attn)
    assert dumped["out"].dtype == io, "the output has the activations' dtype (out_dtype with an fp8 q)"
    out = dumped["out"].astype(np.float64).reshape(expected.shape)
    atol, rtol = TOLERANCES[np.dtype(dumped["out"].dtype).name]
    np.testing.assert_allclose(out, expected, atol=atol, rtol=rtol)


# ================================================================================================ build phase
BUILD_PHASE_METADATA = ["random", "all_ff", "real_pool"]


def build_phase_plan(tmp_path, metadata: str, rng):
    """Both plugins on one step whose metadata is what TensorRT's tactic timing may hand over: random bytes,
    all 0xFF, or (real_pool) a real pool address with a valid block table. Every buffer but the pool is poisoned."""
    cfg = wcfg(has_bias=True, cache_dtype=CacheDType.FP16)
    attn = acfg(cfg)
    step = MIXED
    final = [p + n for p, n in zip(step.past, step.new)]
    table, num_blocks = block_table_for(cfg.pool, final, rng)
    pool = (0.1 * rng.standard_normal(cfg.pool.layout().pool_shape(num_blocks))).astype(np.float16)
    meta = meta_for(step, table)
    qkv, bias = random_qkv(cfg, meta.num_tokens, np.float16, rng)
    plan = Plan(tmp_path)
    if metadata == "real_pool":
        add_pools(plan, cfg.pool, pool)
        plan.tensor("block_table", table)
    else:
        plan.buffer("pool0", bytes([GUARD_BYTE]) * GUARD_BYTES + pool.tobytes() + bytes([GUARD_BYTE]) * GUARD_BYTES)
        if metadata == "random":
            descs = rng.integers(-2 ** 62, 2 ** 62, (1, POOL_DESC_FIELDS), dtype=np.int64)
            garbage = rng.integers(-2 ** 31, 2 ** 31, table.shape, dtype=np.int64).astype(np.int32)
        else:
            descs = np.full((1, POOL_DESC_FIELDS), -1, np.int64)
            garbage = np.full(table.shape, -1, np.int32)
        plan.tensor("kv_pools", descs)
        plan.tensor("block_table", garbage)
    inputs = write_step_tensors(plan, "", cfg, meta, qkv, bias)
    if metadata != "real_pool":  # the lengths as arbitrary as the rest (same shapes: the same step extents)
        for name, n in (("cu_q_lens", meta.cu_q_lens.size), ("past_lens", meta.past_lens.size)):
            plan.tensor(name, rng.integers(-2 ** 31, 2 ** 31, n, dtype=np.int64).astype(np.int32)
                        if metadata == "random" else np.full(n, -1, np.int32))
    plan.step(WRITE_PLUGIN_NAME, cfg, inputs, ["q", "status"])
    plan.tensor("status_in", np.full(STATUS_FIELDS, -1, np.int32))
    plan.step(ATTENTION_PLUGIN_NAME, attn, ["q", "kv_pools", "block_table", "cu_q_lens", "past_lens", "status_in"],
              ["out"])
    return plan, cfg


@pytest.mark.parametrize("metadata", BUILD_PHASE_METADATA)
def test_build_phase_enqueue_reads_and_writes_nothing(host, tmp_path, metadata):
    """TensorRT times tactics by enqueueing the build-phase instance with arbitrary inputs: it must launch nothing
    that could follow kv_pools' addresses or the block table. Outputs keep their poison, the pool and its guards
    their bytes; under compute-sanitizer memcheck (.ci/gpu-run.sh, sanitize stage) no access is reported."""
    plan, cfg = build_phase_plan(tmp_path, metadata, np.random.default_rng(BUILD_PHASE_METADATA.index(metadata)))
    for step in plan.steps:
        step["enqueue_phase"] = "build"
    report, dumped = plan.run(host)
    assert_steps_ok(report)
    assert [s["enqueue_phase"] for s in report["steps"]] == ["build", "build"]
    for name in ("q", "status", "out"):
        assert np.all(dumped[name].view(np.uint8) == 0xFF), f"{name} was written by a build-phase enqueue"
    before = np.frombuffer((plan.dir / "buf_pool0.bin").read_bytes(), dtype=np.uint8)
    assert np.array_equal(dumped["pool0"], before), "the pool was touched by a build-phase enqueue"


def test_runtime_phase_enqueue_of_the_same_plan_writes(host, tmp_path):
    """The control: the engine's (runtime-phase) instances on the real_pool plan do write q, the status and the
    pool, so the build-phase test above can see a write when there is one."""
    plan, cfg = build_phase_plan(tmp_path, "real_pool", np.random.default_rng(2))
    report, dumped = plan.run(host)
    assert_steps_ok(report)
    assert dumped["status"].tolist() == [0] * STATUS_FIELDS and not np.isnan(dumped["q"].astype(np.float32)).any()
    before = np.frombuffer((plan.dir / "buf_pool0.bin").read_bytes(), dtype=np.uint8)
    assert not np.array_equal(dumped["pool0"], before)
