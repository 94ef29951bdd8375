// Step metadata shared by the write and the read side: which tokens of the step belong to which sequence,
// where each sequence's cache stands, and where its pool lives. See docs/plugin_io.md.
//
//   T  tokens in the step (all sequences' new tokens, padding removed, sequence after sequence)
//   B  sequences in the step (prefill chunks, decode tokens, speculative drafts: any mix)
//   MB block-table width (max pages of any sequence of the step)
#pragma once

#include <cstdint>

#include "pagedkv/kv_layout.h"

namespace pagedkv {

// Engine input `kv_pools` is an INT64 device tensor [num_pools, kPoolDescFields]; row g describes pool
// group g. The pool is never a TensorRT tensor: TensorRT can neither copy it nor see it written.
enum PoolDescField : int32_t {
    kPoolDescAddress = 0,    // device address of the pool (cudaMalloc'ed by the KV manager)
    kPoolDescNumBlocks = 1,  // NB: block ids must be in [0, NB)
    kPoolDescReserved0 = 2,  // NVFP4 block-scale pool address (reserved)
    kPoolDescReserved1 = 3,
    kPoolDescFields = 4,
};

struct StepMetadata {
    int64_t const* poolDescs;   // [num_pools, kPoolDescFields] (device)
    int32_t poolIndex;          // which row of poolDescs this layer's pool group is
    int32_t const* blockTable;  // [B, MB] int32, kInvalidBlock (-1) where no page
    int32_t maxBlocks;          // MB
    int32_t const* cuQLens;     // [B + 1] cumulative new-token counts: seq b owns tokens [cuQLens[b], cuQLens[b+1])
    int32_t const* pastLens;    // [B] tokens cached before this step (chunked prefill's past length)
    int32_t numSeqs;            // B
    int32_t numTokens;          // T == cuQLens[B]
};

// Error record written by kernels that meet a bad block-table entry (engine output `kv_write_status`,
// INT32 [kStatusFields]). All zero when the step was clean. The host turns a non-zero flag into an error
// naming the field and the value; the kernel never writes outside the pool.
enum StatusField : int32_t {
    kStatusFlags = 0,      // bitmask of StatusFlag
    kStatusSeq = 1,        // first offending sequence (any of them when several race)
    kStatusPageInSeq = 2,  // its page index within the sequence
    kStatusEntry = 3,      // the block-table entry found there
    kStatusFields = 4,
};
enum StatusFlag : int32_t {
    kStatusInvalidBlock = 1,    // entry == -1 where a live token must go
    kStatusBlockOutOfRange = 2, // entry >= NB or < -1
    kStatusPastBlockTable = 4,  // the token's page index >= MB
};

}  // namespace pagedkv
