// Step metadata built by the C++ KV manager: the same arrays, byte for byte, as Python's
// `KVCacheManager.build_step` (`pagedkv.kvcache.metadata`), which the plugins read through
// `pagedkv::StepMetadata` (step_metadata.h) and a FlashInfer-style consumer reads as page index pointers.
//
// Legend: B sequences of the step, T tokens (sequence after sequence), G pool groups, MB block-table width of
// a group (max pages of the step's sequences in it), NNZ pages of the step in a group. All arrays int32.
//
//   shared:     cu_q_lens [B+1], past_lens [B], q_lens [B], kv_lens [B], token_seq [T], positions [T]
//   per group:  block_table [B, MB] (-1 padded, -1 where a window released a page), num_pages [B],
//               last_page_lens [B], kv_indptr [B+1], kv_indices [NNZ]
//
// Two phases, so that a device runtime writes straight into its pinned staging buffer: `planStep` checks
// the entries and gives the sizes (T, MB and NNZ per group), `writeStep` fills caller buffers. `buildStep`
// does both into a reusable `StepBatch` (its vectors keep their capacity from step to step).
#pragma once

#include <cstdint>
#include <vector>

#include "pagedkv/runtime/kv_errors.h"

namespace pagedkv::runtime {

// One sequence of a step: `numNewTokens` of its reserved slots (< 0: its whole reservation).
struct StepEntry {
    SeqId seq;
    int32_t numNewTokens = -1;
};

// The checked shape of one step. Valid until the manager changes (writeStep refuses a stale plan).
class StepPlan {
public:
    int32_t numSeqs = 0;                // B
    int32_t numTokens = 0;              // T
    int32_t maxQLen = 0, maxKVLen = 0;  // 0 for an empty step
    std::vector<int32_t> maxBlocks;     // [G] MB of each group
    std::vector<int32_t> numIndices;    // [G] NNZ of each group
    std::vector<SeqId> seqIds;          // [B] in step order

private:
    friend class KVManager;
    std::vector<int32_t> slots_;  // [B] the sequences' storage slots
    std::vector<int32_t> past_;   // [B]
    std::vector<int32_t> q_;      // [B]
    std::vector<int32_t> pages_;  // [G * B] pages_needed(kv_len) per group
    void const* owner_ = nullptr;
    uint64_t version_ = 0;
};

// Where writeStep puts each array (element counts from the plan). A null pointer skips that array.
struct GroupStepBuffers {
    int32_t* blockTable = nullptr;    // [B * W], W = blockTableWidth (0: MB); columns past a row's pages are -1
    int32_t blockTableWidth = 0;      // an engine's static width or a CUDA-graph bucket (>= MB)
    int32_t* numPages = nullptr;      // [B]
    int32_t* lastPageLens = nullptr;  // [B]
    int32_t* kvIndptr = nullptr;      // [B + 1]
    int32_t* kvIndices = nullptr;     // [NNZ]
};
struct StepBuffers {
    int32_t* cuQLens = nullptr;                // [B + 1]
    int32_t* pastLens = nullptr;               // [B]
    int32_t* qLens = nullptr;                  // [B]
    int32_t* kvLens = nullptr;                 // [B]
    int32_t* tokenSeq = nullptr;               // [T]
    int32_t* positions = nullptr;              // [T]
    GroupStepBuffers const* groups = nullptr;  // [G], or null for none of the per-group arrays
};

// A step's arrays in owned vectors (reused across steps).
class StepBatch {
public:
    struct Group {
        std::vector<int32_t> blockTable, numPages, lastPageLens, kvIndptr, kvIndices;
    };
    StepPlan plan;
    std::vector<int32_t> cuQLens, pastLens, qLens, kvLens, tokenSeq, positions;
    std::vector<Group> groups;

    // Size every vector for `plan` and return buffers pointing into them.
    StepBuffers resizeFor(StepPlan const& stepPlan);

private:
    std::vector<GroupStepBuffers> groupBuffers_;
};

}  // namespace pagedkv::runtime
