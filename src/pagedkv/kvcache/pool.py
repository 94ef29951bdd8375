"""Device pools and the pinned host tier, through cuda-python (``pagedkv.cuda``; never torch).

One ``DeviceBuffer`` per pool group holds ``num_blocks`` blocks laid out as ``KVLayout.pool_shape``
(``[NB, L, 2, KVH, P, D]`` for HND); the optional secondary tier is one pinned host allocation
(``cudaHostAlloc``) per group with the same block layout. ``BlockCopy`` records become one
``cudaMemcpyAsync`` (whole block: blocks are contiguous) or one ``cudaMemcpy2DAsync`` (the first N tokens of
every (layer, K/V, head) row, ``copies.copy_plan``), enqueued on the manager's stream. No kernel is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedkv import cuda
from pagedkv.cuda import PinnedBuffer
from pagedkv.kvcache.copies import BlockCopy, Tier, copy_plan
from pagedkv.pool_group import PoolGroup


_KIND_NAMES = {
    (Tier.PRIMARY, Tier.PRIMARY): "cudaMemcpyDeviceToDevice",
    (Tier.PRIMARY, Tier.SECONDARY): "cudaMemcpyDeviceToHost",
    (Tier.SECONDARY, Tier.PRIMARY): "cudaMemcpyHostToDevice",
    (Tier.SECONDARY, Tier.SECONDARY): "cudaMemcpyHostToHost",
}


class DevicePools:
    """The pools of all groups on the device, plus the optional pinned secondary tier."""

    def __init__(self, groups: Sequence[PoolGroup], num_blocks: Sequence[int], host_blocks: Sequence[int],
                 stream: cuda.Stream, poison: bool = True):
        self.groups = tuple(groups)
        self.num_blocks = list(num_blocks)
        self.host_blocks = list(host_blocks)
        self.stream = stream
        self.primary: list[cuda.DeviceBuffer] = []
        self.secondary: list[PinnedBuffer | None] = []
        try:
            for spec, nb, hb in zip(self.groups, self.num_blocks, self.host_blocks):
                buf = cuda.DeviceBuffer(spec.block_bytes * nb)
                self.primary.append(buf)
                if poison:  # 0xFF bytes: NaN for fp16/bf16/fp8-e4m3, -1 for int8
                    buf.fill_bytes(0xFF, stream)
                host = PinnedBuffer(spec.block_bytes * hb) if hb else None
                if host is not None and poison:
                    host.view().fill(0xFF)
                self.secondary.append(host)
            stream.synchronize()
        except BaseException:
            self.close()
            raise

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.primary)

    def address(self, group: int, tier: Tier = Tier.PRIMARY) -> int:
        if tier == Tier.PRIMARY:
            return self.primary[group].ptr
        host = self.secondary[group]
        if host is None:
            raise ValueError(f"group {self.groups[group].name!r} has no secondary tier (host_blocks=0)")
        return host.ptr

    def block_address(self, group: int, tier: Tier, block: int) -> int:
        count = self.num_blocks[group] if tier == Tier.PRIMARY else self.host_blocks[group]
        if not 0 <= block < count:
            raise IndexError(f"block {block} outside [0, {count}) of group {self.groups[group].name!r} ({tier.name})")
        return self.address(group, tier) + block * self.groups[group].block_bytes

    def copy(self, c: BlockCopy) -> None:
        """Enqueue one block copy on the stream (cudaMemcpyAsync or cudaMemcpy2DAsync)."""
        rt = cuda._rt()
        spec = self.groups[c.group]
        plan = copy_plan(spec.layout, spec.itemsize, c.num_tokens)
        dst = self.block_address(c.group, c.dst_tier, c.dst_block)
        src = self.block_address(c.group, c.src_tier, c.src_block)
        kind = getattr(rt.cudaMemcpyKind, _KIND_NAMES[(c.src_tier, c.dst_tier)])
        if plan.contiguous:
            cuda.check(rt.cudaMemcpyAsync(dst, src, plan.rows * plan.width, kind, self.stream.raw),
                       f"cudaMemcpyAsync block copy {c}")
        else:
            cuda.check(rt.cudaMemcpy2DAsync(dst, plan.pitch, src, plan.pitch, plan.width, plan.rows, kind,
                                            self.stream.raw), f"cudaMemcpy2DAsync block copy {c}")

    def upload_blocks(self, group: int, pool: np.ndarray, blocks) -> None:
        """Copy blocks of a host numpy pool (``pool_shape`` of this group) to the same device blocks."""
        spec = self.groups[group]
        expect = spec.pool_shape(self.num_blocks[group])
        if pool.shape != expect or pool.dtype != spec.cache_dtype.numpy_dtype:
            raise ValueError(f"upload_blocks: expected a {expect} {spec.cache_dtype.name} pool, got "
                             f"{pool.shape} {pool.dtype}")
        for b in blocks:
            b = int(b)
            self.primary[group].upload(np.ascontiguousarray(pool[b]), self.stream, offset=b * spec.block_bytes)
            self.stream.synchronize()  # the source slice may be a temporary

    def download(self, group: int, tier: Tier = Tier.PRIMARY) -> np.ndarray:
        """The whole pool of a group as a numpy array of ``pool_shape`` (synchronises the stream)."""
        spec = self.groups[group]
        if tier == Tier.PRIMARY:
            shape = spec.pool_shape(self.num_blocks[group])
            return self.primary[group].download(shape, spec.cache_dtype.numpy_dtype, self.stream)
        self.stream.synchronize()
        host = self.secondary[group]
        shape = spec.pool_shape(self.host_blocks[group])
        if host is None:
            return np.empty(shape, dtype=spec.cache_dtype.numpy_dtype)
        return host.view(spec.cache_dtype.numpy_dtype, shape).copy()

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        """Free every pool (idempotent). Waits for the stream so no copy still uses the memory."""
        if self.stream is not None:
            try:
                self.stream.synchronize()
            except cuda.CudaError:  # a sticky device error must not keep the memory alive
                pass
        for buf in self.primary:
            buf.close()
        for host in self.secondary:
            if host is not None:
                host.close()
        self.primary, self.secondary = [], []
