"""Step metadata to the device: pack every array of a ``StepBatch`` into one pinned staging buffer and send
it with a single ``cudaMemcpyAsync`` on the manager's stream.

Two slots (staging + device buffer + event) alternate, so the host can pack step n+1 while step n's copy
is in flight; before reusing a slot the host waits on that slot's event (its previous copy has left the
staging buffer). A ``DeviceStep`` therefore stays valid until two more steps have been uploaded. Kernels
that read it must run on the same stream (or wait for it).

The packing itself (``pack_layout`` / ``pack_into``) is plain numpy, so its offsets are tested on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedkv import cuda
from pagedkv.kvcache.metadata import StepBatch

ALIGN = 256  # bytes: every array starts on a 256-byte boundary (cudaMalloc alignment, coalesced reads)


def step_arrays(step: StepBatch) -> list[tuple[str, np.ndarray]]:
    """The arrays of a step, named ``name`` (shared) or ``name[g]`` (pool group g), in packing order."""
    arrays = [("cu_q_lens", step.cu_q_lens), ("past_lens", step.past_lens), ("kv_lens", step.kv_lens),
              ("token_seq", step.token_seq), ("positions", step.positions)]
    if step.position_ids is not None:
        arrays.append(("position_ids", step.position_ids))
    for g, gs in enumerate(step.groups):
        arrays += [(f"block_table[{g}]", gs.meta.block_table), (f"last_page_lens[{g}]", gs.last_page_lens),
                   (f"kv_indptr[{g}]", gs.kv_indptr), (f"kv_indices[{g}]", gs.kv_indices)]
    return arrays


def pack_layout(arrays) -> tuple[dict[str, int], int]:
    """Byte offset of each array in the packed buffer, and the total size."""
    offsets, size = {}, 0
    for name, arr in arrays:
        offsets[name] = size
        size += -(-arr.nbytes // ALIGN) * ALIGN
    return offsets, size


def pack_into(buffer: np.ndarray, arrays, offsets: dict[str, int]) -> None:
    """Copy each array's bytes to its offset of a flat uint8 ``buffer``."""
    for name, arr in arrays:
        raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        buffer[offsets[name]:offsets[name] + raw.size] = raw


@dataclass
class DeviceStep:
    """Device addresses of an uploaded step's arrays."""

    step: StepBatch
    base: int
    offsets: dict

    def address(self, name: str) -> int:
        return self.base + self.offsets[name]

    def metadata_fields(self, group: int, kv_pools_address: int) -> dict:
        """The fields of the C struct ``pagedkv::StepMetadata`` for pool group ``group``."""
        gs = self.step.groups[group]
        return {"poolDescs": kv_pools_address, "poolIndex": gs.pool_index,
                "blockTable": self.address(f"block_table[{group}]"), "maxBlocks": gs.meta.max_blocks,
                "cuQLens": self.address("cu_q_lens"), "pastLens": self.address("past_lens"),
                "numSeqs": self.step.num_seqs, "numTokens": self.step.num_tokens}


class _Slot:
    def __init__(self):
        from pagedkv.cuda import Event

        self.staging = None
        self.device = None
        self.capacity = 0
        self.event = Event()

    def ensure(self, nbytes: int) -> None:
        if self.staging is not None and nbytes <= self.capacity:
            return
        from pagedkv.cuda import PinnedBuffer

        self.event.synchronize()
        self.release_buffers()
        self.capacity = max(nbytes, 2 * self.capacity, 64 * 1024)
        self.staging = PinnedBuffer(self.capacity)
        self.device = cuda.DeviceBuffer(self.capacity)

    def release_buffers(self) -> None:
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        if self.device is not None:
            self.device.close()
            self.device = None
        self.capacity = 0


class StepUploader:
    def __init__(self, stream: cuda.Stream, num_slots: int = 2):
        self.stream = stream
        self._slots = [_Slot() for _ in range(num_slots)]
        self._next = 0

    def upload(self, step: StepBatch) -> DeviceStep:
        arrays = step_arrays(step)
        offsets, size = pack_layout(arrays)
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        slot.event.synchronize()  # the slot's previous copy has read its staging buffer
        slot.ensure(size)
        pack_into(slot.staging.view(), arrays, offsets)
        rt = cuda._rt()
        cuda.check(rt.cudaMemcpyAsync(slot.device.ptr, slot.staging.ptr, size,
                                      rt.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream.raw),
                   "cudaMemcpyAsync step metadata")
        slot.event.record(self.stream)
        return DeviceStep(step, slot.device.ptr, offsets)

    def close(self) -> None:
        for slot in self._slots:
            slot.event.synchronize()
            slot.release_buffers()
            slot.event.close()
        self._slots = []
