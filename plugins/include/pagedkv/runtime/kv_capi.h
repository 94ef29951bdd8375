// C API of the C++ KV manager (libpagedkv_runtime.so), for ctypes (src/pagedkv/kvcache/native.py builds
// its mirrors from pagedkv_kv_struct_layouts) and for C callers. Every entry returns a pagedkv_kv_status; on failure,
// pagedkv_kv_last_error() describes it (code, the sequence, the exhaustion numbers, the doctor's check)
// until the next failing call on the same thread. Sequence ids are int64.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PAGEDKV_KV_CAPI_VERSION 1
#define PAGEDKV_KV_EXPORT __attribute__((visibility("default")))

typedef enum pagedkv_kv_status {
    PAGEDKV_KV_OK = 0,
    PAGEDKV_KV_EXHAUSTED = 1,         // not enough free blocks; nothing changed (Python KVCacheExhaustedError)
    PAGEDKV_KV_INVALID_ARGUMENT = 2,  // bad value or state (Python ValueError)
    PAGEDKV_KV_UNKNOWN_SEQUENCE = 3,  // (Python KeyError)
    PAGEDKV_KV_REFCOUNT = 4,          // double free (Python BlockRefcountError)
    PAGEDKV_KV_INVARIANT = 5,         // the validator's finding (Python KVInvariantError)
    PAGEDKV_KV_INTERNAL = 6,          // anything else (out of memory, a bug)
    // the runtime's entries (runtime_capi.h)
    PAGEDKV_KV_CONTEXT_LENGTH = 7,  // prompt + max_new_tokens beyond the context limit (Python ContextLengthError)
    PAGEDKV_KV_WRITE_STATUS = 8,    // a layer's kv_write_status was not clean: seq, page, block = the entry
                                    // (Python KVWriteError)
    PAGEDKV_KV_TENSORRT_UNAVAILABLE = 9,  // libnvinfer could not be loaded (trt_engine.h TensorRTUnavailable)
    PAGEDKV_KV_PLUGIN_LIBRARY = 10,       // the plugin library is missing or not ours (PluginLibraryError)
    PAGEDKV_KV_ENGINE_MISMATCH = 11,      // the engine's I/O, GPU or TensorRT version (EngineMismatchError)
} pagedkv_kv_status;

typedef struct pagedkv_kv_error {
    int32_t code;     // pagedkv_kv_status
    int32_t has_seq;  // 1 when `seq` names the sequence the error is about
    int64_t seq;
    const char* message;  // the full message (the Python manager's wording)
    // PAGEDKV_KV_EXHAUSTED
    int64_t needed, free;
    int32_t tier;       // 0 primary, 1 secondary
    const char* group;  // pool group name ("" when none applies)
    const char* what;   // the operation that ran out ("" when none)
    // PAGEDKV_KV_REFCOUNT / PAGEDKV_KV_INVARIANT
    int32_t has_block, has_page;
    int64_t block;
    int32_t page;
    int32_t refcount;
    const char* check;  // the doctor's check name ("" otherwise)
    const char* detail;
    const char* expected;
    const char* found;
} pagedkv_kv_error;

// One pool group: the KVLayout fields, the cache dtype, the window and the tiers' block counts.
typedef struct pagedkv_kv_group_desc {
    const char* name;
    int32_t num_layers, num_kv_heads, page_size, head_dim;
    int32_t page_layout;  // 0 HND, 1 NHD
    int32_t ring_sink_tokens, cyclic_len;
    int32_t cache_dtype;  // 0 fp16, 1 bf16, 2 fp8 e4m3, 3 int8
    int32_t window, attention_sinks;
    int64_t num_blocks, host_blocks;
} pagedkv_kv_group_desc;

typedef struct pagedkv_kv_group_stats {
    int32_t num_blocks, num_free, host_blocks, host_free, num_cached;
} pagedkv_kv_group_stats;

typedef struct pagedkv_kv_seq_info {
    int32_t length, reserved, prompt_len, prefill_remaining, swapped;
} pagedkv_kv_seq_info;

typedef struct pagedkv_kv_block_copy {
    int32_t group, src_tier, src_block, dst_tier, dst_block, num_tokens;  // num_tokens <= 0: whole block
} pagedkv_kv_block_copy;

typedef struct pagedkv_kv_step_shape {
    int32_t num_seqs, num_tokens, max_q_len, max_kv_len;
} pagedkv_kv_step_shape;

// Destinations of a planned step (element counts from the plan). NULL skips an array.
typedef struct pagedkv_kv_step_buffers {
    int32_t *cu_q_lens, *past_lens, *q_lens, *kv_lens, *token_seq, *positions;
} pagedkv_kv_step_buffers;
typedef struct pagedkv_kv_group_step_buffers {
    int32_t *block_table, *num_pages, *last_page_lens, *kv_indptr, *kv_indices;
} pagedkv_kv_group_step_buffers;

typedef struct pagedkv_kv_manager pagedkv_kv_manager;

PAGEDKV_KV_EXPORT int32_t pagedkv_kv_capi_version(void);
// Every struct of this API described field by field as JSON (pagedkv/struct_description.h), for bindings that
// build their mirrors from the library (src/pagedkv/kvcache/native.py through pagedkv.kernels._structs).
PAGEDKV_KV_EXPORT const char* pagedkv_kv_struct_layouts(void);
PAGEDKV_KV_EXPORT const pagedkv_kv_error* pagedkv_kv_last_error(void);

PAGEDKV_KV_EXPORT int32_t pagedkv_kv_create(const pagedkv_kv_group_desc* groups, int32_t num_groups,
                                            int32_t enable_prefix_reuse, pagedkv_kv_manager** out);
// Frees the handle; a handle borrowed from an engine (pagedkv_rt_engine_kv) leaves the engine's manager alone.
PAGEDKV_KV_EXPORT void pagedkv_kv_destroy(pagedkv_kv_manager* mgr);

// ---- sequences ----
// `reused` (may be NULL): tokens taken from the prefix cache, the committed length.
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_add_sequence(pagedkv_kv_manager* mgr, int64_t seq, const int32_t* prompt,
                                                  int32_t prompt_len, const uint8_t* salt, size_t salt_len,
                                                  int32_t* reused);
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_reserve(pagedkv_kv_manager* mgr, int64_t seq, int32_t num_tokens);
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_unreserve(pagedkv_kv_manager* mgr, int64_t seq);
// token_ids: [token_count] ids (token_count must equal num_tokens) or NULL (unknown tokens: no prefix
// registration past them).
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_commit(pagedkv_kv_manager* mgr, int64_t seq, int32_t num_tokens,
                                            const int32_t* token_ids, int64_t token_count);
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_free(pagedkv_kv_manager* mgr, int64_t seq);
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_fork(pagedkv_kv_manager* mgr, int64_t src, int64_t dst);
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_swap_out(pagedkv_kv_manager* mgr, int64_t seq);
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_swap_in(pagedkv_kv_manager* mgr, int64_t seq);
// One call per step for many sequences, in order (the same as one call each): the first failure stops the
// loop; `done` (may be NULL) is the number of sequences handled before it. commit_many's token_ids are the
// sequences' tokens back to back (sum of counts) or NULL.
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_reserve_many(pagedkv_kv_manager* mgr, const int64_t* seqs, const int32_t* counts,
                                                  int32_t n, int32_t* done);
// reserve for every sequence, all-or-nothing (Python's KVCacheManager.reserve_many): on failure nothing changed.
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_reserve_all(pagedkv_kv_manager* mgr, const int64_t* seqs, const int32_t* counts,
                                                 int32_t n);
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_commit_many(pagedkv_kv_manager* mgr, const int64_t* seqs, const int32_t* counts,
                                                 const int32_t* token_ids, int32_t n, int32_t* done);

// ---- queries ----
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_num_groups(const pagedkv_kv_manager* mgr);
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_num_sequences(const pagedkv_kv_manager* mgr);
// The ids in the order they were added; `count` gets the number of sequences (capacity may be 0 to ask).
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_sequences(const pagedkv_kv_manager* mgr, int64_t* out, int32_t capacity,
                                               int32_t* count);
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_contains(const pagedkv_kv_manager* mgr, int64_t seq);
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_sequence_info(const pagedkv_kv_manager* mgr, int64_t seq,
                                                   pagedkv_kv_seq_info* out);
// Block list of `seq` in `group`; `count` gets its length (pass capacity 0 to ask).
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_block_list(const pagedkv_kv_manager* mgr, int64_t seq, int32_t group, int32_t* out,
                                                int32_t capacity, int32_t* count);
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_stats(const pagedkv_kv_manager* mgr, int32_t group, pagedkv_kv_group_stats* out);
// The free list of a tier from head to tail / the cached prefix blocks (ascending), same count protocol.
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_free_list(const pagedkv_kv_manager* mgr, int32_t group, int32_t tier, int32_t* out,
                                               int32_t capacity, int32_t* count);
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_cached_blocks(const pagedkv_kv_manager* mgr, int32_t group, int32_t* out,
                                                   int32_t capacity, int32_t* count);
// The recorded block copies since the last drain, oldest first: `count` gets their number; they are moved
// out (drained) only when capacity >= count.
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_drain_copies(pagedkv_kv_manager* mgr, pagedkv_kv_block_copy* out, int64_t capacity,
                                                  int64_t* count);

// ---- step metadata ----
// Check a step (num_new[i] < 0: sequence i's whole reservation) and give its sizes: max_blocks[g] (MB) and
// num_indices[g] (NNZ), one per group. The plan is kept in the manager for write_step.
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_plan_step(pagedkv_kv_manager* mgr, const int64_t* seqs, const int32_t* num_new,
                                               int32_t num_seqs, pagedkv_kv_step_shape* shape, int32_t* max_blocks,
                                               int32_t* num_indices);
// Write the last planned step (refused if the manager changed since) into caller buffers; `groups`: [G].
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_write_step(pagedkv_kv_manager* mgr, const pagedkv_kv_step_buffers* shared,
                                                const pagedkv_kv_group_step_buffers* groups);
// The kv_pools engine input: out [G * 4] int64, row g = (addresses[g], num_blocks[g], 0, 0).
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_pool_descriptors(const pagedkv_kv_manager* mgr, const uint64_t* addresses,
                                                      int64_t* out);

// ---- the kv doctor ----
PAGEDKV_KV_EXPORT int32_t pagedkv_kv_validate(const pagedkv_kv_manager* mgr);

#ifdef __cplusplus
}
#endif
