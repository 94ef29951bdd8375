"""KV manager on a real device: pools laid out as the contract says, the numpy reference writing through the
manager's block tables into device memory, device block copies (copy-on-write, offload/reload, partial
copies) bit-exact against the numpy pools running the same bookkeeping, step-metadata upload, memory back
to its baseline, byte-budget sizing. Every comparison is on raw bytes (NaN poison included)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pagedkv import cuda
from pagedkv.config import WriteConfig
from pagedkv.kvcache import BlockCopy, KVCacheManager, PoolGroup, Tier, apply_copies
from pagedkv.kvcache.pool import DevicePools
from pagedkv.layout import CacheDType, KVLayout, PageLayout

pytestmark = pytest.mark.gpu


def download_address(ptr: int, shape, dtype) -> np.ndarray:
    out = np.empty(shape, dtype=dtype)
    rt = cuda._rt()
    cuda.check(rt.cudaMemcpy(out.ctypes.data, ptr, out.nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost), "D2H")
    return out


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                                                 np.ascontiguousarray(b).view(np.uint8))


def random_bits(shape, dtype, rng) -> np.ndarray:
    """Random bytes as ``dtype`` (every bit pattern, NaNs included: copies must be bit-exact)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return rng.integers(0, 256, n, dtype=np.uint8).view(dtype).reshape(shape)


CASES = [
    ("fp16-hnd", CacheDType.FP16, PageLayout.HND),
    ("bf16-nhd", CacheDType.BF16, PageLayout.NHD),
    ("fp8-hnd", CacheDType.FP8_E4M3, PageLayout.HND),
    ("int8-nhd", CacheDType.INT8, PageLayout.NHD),
]


def _spec(dtype, page_layout):
    quant = dtype.quantized
    return PoolGroup("g", KVLayout(2, 2, 16, 64, page_layout), dtype,
                     k_scales=(0.05, 0.08) if quant else None, v_scales=(0.04, 0.07) if quant else None)


@pytest.mark.parametrize("name, dtype, page_layout", CASES, ids=[c[0] for c in CASES])
def test_pools_follow_the_contract_layout(name, dtype, page_layout):
    spec = _spec(dtype, page_layout)
    other = PoolGroup("h", KVLayout(3, 1, 8, 128), CacheDType.BF16)
    with KVCacheManager([spec, other], [10, 7], host_blocks=[3, 2], storage="device") as mgr:
        pools = mgr.storage
        assert pools.primary[0].nbytes == spec.layout.pool_elements(10) * dtype.itemsize
        assert pools.primary[1].nbytes == other.layout.pool_elements(7) * 2
        desc = mgr.kv_pools()
        assert desc[:, 0].tolist() == [pools.address(0), pools.address(1)] and desc[:, 1].tolist() == [10, 7]
        dev_desc = mgr.kv_pools_device()
        assert download_address(dev_desc.ptr, desc.shape, np.int64).tolist() == desc.tolist()
        assert pools.block_address(0, Tier.PRIMARY, 3) == pools.address(0) + 3 * spec.block_bytes
        # poisoned at allocation; an uploaded host pool comes back bit-exact in pool_shape
        assert np.all(pools.download(0).view(np.uint8) == 0xFF)
        rng = np.random.default_rng(0)
        host = random_bits(spec.pool_shape(10), dtype.numpy_dtype, rng)
        pools.upload_blocks(0, host, range(10))
        assert same_bytes(pools.download(0), host)
        # block b of the contract's element offsets is where the manager's address arithmetic puts it
        lay = spec.layout
        off = int(lay.elem_offset(4, 1, 1, 1, 5)) * dtype.itemsize
        got = download_address(pools.address(0) + off, (lay.head_dim,), dtype.numpy_dtype)
        assert same_bytes(got, host.reshape(-1)[off // dtype.itemsize:off // dtype.itemsize + lay.head_dim])


@pytest.mark.parametrize("name, dtype, page_layout", CASES, ids=[c[0] for c in CASES])
def test_reference_write_through_the_manager_into_device_pools(name, dtype, page_layout):
    """Steps (chunked prefill, fork + copy-on-write, decode, prefix reuse) written by the numpy reference
    into a host mirror through the manager's step metadata, uploaded block by block to the device pool at the
    manager's addresses; device copies happen on the device. Device pool == mirror, byte for byte, after every
    step (so the device copy-on-write is checked before the written blocks are uploaded)."""
    write = pytest.importorskip("pagedkv.reference.write", reason="the numpy write reference is not available")
    spec = _spec(dtype, page_layout)
    rng = np.random.default_rng(1)
    H = 4
    with KVCacheManager([spec], 24, storage="device", enable_prefix_reuse=True) as mgr:
        mirror = np.empty(spec.pool_shape(24), dtype=dtype.numpy_dtype)
        mirror.view(np.uint8).fill(0xFF)  # the device pools start poisoned the same way

        def step(entries):
            for sid, n in entries:
                mgr.reserve(sid, n)
            apply_copies(mgr.groups, mgr.drain_copies(), [mirror])
            assert same_bytes(mgr.storage.download(0), mirror), "device copies differ from the mirror's"
            st = mgr.build_step(entries)
            mgr.validate_step(st)
            for layer in range(spec.layout.num_layers):
                cfg = WriteConfig(num_q_heads=H, pool=spec.pool_config(layer, 0))
                qkv = rng.standard_normal((st.num_tokens, (H + 2 * spec.layout.num_kv_heads) * 64))
                write.qkv_write(qkv.astype(np.float16), None, st.meta(0), mirror, cfg)
            touched = np.unique(st.groups[0].kv_indices)
            mgr.storage.upload_blocks(0, mirror, touched[touched >= 0])
            assert same_bytes(mgr.storage.download(0), mirror)
            for sid, n in entries:  # prompt tokens are known; generated ones come with the step
                mgr.commit(sid, n, None if mgr.prefill_remaining(sid) else rng.integers(1, 1000, n))

        prompt = rng.integers(1, 1000, 40)
        mgr.add_sequence("a", prompt)
        step([("a", 16)])
        step([("a", 24)])            # chunked prefill: past 16
        mgr.fork("a", "b")
        step([("a", 1), ("b", 1)])   # both decode into the shared partial page: one device copy-on-write
        assert mgr.add_sequence("c", prompt[:33]) == 32  # prefix reuse of two full pages
        step([("c", 1), ("b", 3), ("a", 1)])


@pytest.mark.parametrize("page_layout", [PageLayout.HND, PageLayout.NHD])
def test_device_copies_match_numpy_copies(page_layout):
    """Same operations on a device manager and a numpy manager: identical bookkeeping, so the device pools
    (both tiers) must equal the numpy pools byte for byte: whole-block and 2-D partial copies, D2D, D2H, H2D."""
    groups = [_spec(CacheDType.BF16, page_layout),
              PoolGroup("ring", KVLayout(1, 2, 16, 64, page_layout, cyclic_len=32), CacheDType.FP16, window=24)]
    rng = np.random.default_rng(2)
    with KVCacheManager(groups, 12, host_blocks=8, storage="device") as dev:
        ref = KVCacheManager(groups, 12, host_blocks=8, storage="numpy")
        for g, spec in enumerate(groups):  # the same random (non-NaN-poisoned) contents in both
            content = random_bits(spec.pool_shape(12), spec.cache_dtype.numpy_dtype, rng)
            dev.storage.upload_blocks(g, content, range(12))
            ref.pool(g)[...] = content
        for m in (dev, ref):
            m.add_sequence("a")
            for _ in range(5):
                m.reserve("a", 7)
                m.commit("a", 7)        # 35 tokens: linear pages 0-2 (3 tokens in page 2), ring wrapped
            m.fork("a", "b")
            m.reserve("b", 2)           # copy-on-write: partial linear page, whole ring pages
            m.commit("b", 2)
            m.swap_out("a")             # D2H, partial last page
            m.add_sequence("c")
            for _ in range(5):          # reuses a's freed device blocks (ring steps <= 32 - 24 + 1 tokens)
                m.reserve("c", 8)
                m.commit("c", 8)
            m.free("c")
            m.swap_in("a")              # H2D into other blocks
        assert dev.drain_copies() == ref.drain_copies()
        for g in range(len(groups)):
            for tier in (Tier.PRIMARY, Tier.SECONDARY):
                assert same_bytes(dev.storage.download(g, tier), ref.storage.pool(g, tier)), (g, tier)


@pytest.mark.parametrize("page_layout", [PageLayout.HND, PageLayout.NHD])
@pytest.mark.parametrize("num_tokens", [1, 5, 15, 0])
def test_offload_reload_partial_copy_bit_exact(page_layout, num_tokens):
    spec = PoolGroup("g", KVLayout(3, 4, 16, 128, page_layout), CacheDType.BF16)
    rng = np.random.default_rng(num_tokens)
    with cuda.Stream() as stream:
        pools = DevicePools([spec], [4], [3], stream, poison=True)
        try:
            block = random_bits(spec.pool_shape(1), np.uint16, rng).view(spec.cache_dtype.numpy_dtype)
            full = np.empty(spec.pool_shape(4), dtype=block.dtype)
            full.view(np.uint8).fill(0xFF)
            full[1] = block[0]
            pools.upload_blocks(0, full, [1])
            pools.copy(BlockCopy(0, Tier.PRIMARY, 1, Tier.SECONDARY, 2, num_tokens))   # offload
            pools.copy(BlockCopy(0, Tier.SECONDARY, 2, Tier.PRIMARY, 3, num_tokens))   # reload elsewhere
            host, back = pools.download(0, Tier.SECONDARY), pools.download(0)
        finally:
            pools.close()
    n = 16 if num_tokens <= 0 else num_tokens
    tok = (slice(None),) * 3 + (slice(None, n),) if page_layout == PageLayout.HND else (slice(None),) * 2 + (slice(None, n),)
    rest = tok[:-1] + (slice(n, None),)
    for got in (host[2], back[3]):
        assert same_bytes(got[tok], block[0][tok])
        assert np.all(got[rest].view(np.uint8) == 0xFF)  # rows past N untouched (poison)
    assert np.all(host[:2].view(np.uint8) == 0xFF) and np.all(back[0].view(np.uint8) == 0xFF)


def test_step_upload_round_trip_and_slot_reuse():
    spec = PoolGroup("g", KVLayout(1, 1, 16, 64))
    win = PoolGroup("w", KVLayout(1, 1, 8, 64), window=30)
    with KVCacheManager([spec, win], 64, storage="device") as mgr:
        uploads = []
        for s in range(5):
            mgr.add_sequence(s)
            mgr.reserve(s, 20 + 9 * s)
        for s in range(3):
            step = mgr.build_step([(x, 1 + s) for x in range(5)], position_ids=np.arange(5 * (1 + s)) + 100)
            uploads.append(mgr.upload_step(step))
            mgr.stream.synchronize()
            from pagedkv.kvcache.upload import step_arrays

            for name, arr in step_arrays(step):
                got = download_address(uploads[-1].address(name), arr.shape, arr.dtype)
                np.testing.assert_array_equal(got, arr, err_msg=name)
        assert uploads[0].base == uploads[2].base != uploads[1].base  # two slots alternate
        fields = uploads[2].metadata_fields(1, mgr.kv_pools_device().ptr)
        assert fields["numSeqs"] == 5 and fields["numTokens"] == 15 and fields["poolIndex"] == 1


def test_memory_returns_to_baseline_after_many_sequences():
    spec = PoolGroup("g", KVLayout(4, 8, 16, 128), CacheDType.BF16)
    with KVCacheManager([spec], 64, host_blocks=8, storage="device") as warm:  # lazy runtime allocations
        warm.add_sequence(0)
        warm.reserve(0, 3)
        warm.upload_step(warm.build_step([0]))
    cuda.synchronize()
    baseline, _ = cuda.mem_get_info()
    live_baseline = cuda.live_device_bytes()
    mgr = KVCacheManager([spec], 4096, host_blocks=64, storage="device")
    try:
        # Per process (other test processes share the GPU): the pools are really allocated.
        assert cuda.live_device_bytes() - live_baseline >= mgr.storage.nbytes
        rng = np.random.default_rng(4)
        live = []
        for s in range(10_000):
            mgr.add_sequence(s)
            live.append(s)
            mgr.reserve(s, int(rng.integers(1, 300)))
            if s % 50 == 0:
                mgr.upload_step(mgr.build_step([s]))
            mgr.commit(s, mgr.reserved(s))
            if s % 7 == 0 and mgr.length(s) < 200:
                mgr.swap_out(s)
                mgr.swap_in(s)
            while len(live) > 12 or (live and rng.random() < 0.4):
                mgr.free(live.pop(int(rng.integers(len(live)))))
        for s in live:
            mgr.free(s)
        mgr.validate()
        assert mgr.num_free() == 4096
    finally:
        mgr.close()
    cuda.synchronize()
    after, _ = cuda.mem_get_info()
    # Exact: every device byte this process allocated through pagedkv is returned.
    assert cuda.live_device_bytes() == live_baseline, \
        f"device memory not returned: {cuda.live_device_bytes() - live_baseline} bytes still held"
    # Device-wide free memory is shared with every other process on the GPU (the GPU suite runs its tests in
    # parallel workers), so it says something only when this process is alone: .ci/gpu-run.sh runs this test
    # once more on its own (PAGEDKV_SERIAL_GPU_TEST=1). The driver allocates in 2 MiB granules: the bound is
    # far below one leaked pool (1 GiB here) or 10^4 leaked metadata buffers.
    if os.environ.get("PAGEDKV_SERIAL_GPU_TEST") == "1":
        assert abs(baseline - after) <= 64 * 2**20, f"device free memory moved by {baseline - after} bytes"


def test_byte_budget_sizing():
    groups = [PoolGroup("full", KVLayout(8, 8, 16, 128), CacheDType.BF16),
              PoolGroup("win", KVLayout(4, 4, 32, 128), CacheDType.FP8_E4M3, window=512)]
    # Free device memory is shared with the other test workers on the GPU: the budget the manager derived
    # from it is checked exactly only when this test runs alone (.ci/gpu-run.sh, PAGEDKV_SERIAL_GPU_TEST=1);
    # the split between the groups and the allocation itself are checked always.
    alone = os.environ.get("PAGEDKV_SERIAL_GPU_TEST") == "1"
    free_before, _ = cuda.mem_get_info()
    live_before = cuda.live_device_bytes()
    fraction = 0.05
    with KVCacheManager.from_memory_budget(groups, fraction, shares=[0.75, 0.25]) as mgr:
        used = [nb * g.block_bytes for nb, g in zip(mgr.num_blocks, groups)]
        if alone:
            budget = fraction * free_before
            assert sum(used) <= budget  # (the manager read free memory just after free_before: nothing in between)
            for share, u, g in zip((0.75, 0.25), used, groups):
                assert share * budget - g.block_bytes < u <= share * budget + g.block_bytes
        # The shares hold whatever the budget was: each group within two blocks of its share of the total.
        total = sum(used)
        for share, u, g in zip((0.75, 0.25), used, groups):
            assert abs(u - share * total) <= 2 * max(x.block_bytes for x in groups)
        assert cuda.live_device_bytes() - live_before >= sum(used)  # the pools are really allocated
        assert mgr.storage.nbytes == sum(used)
