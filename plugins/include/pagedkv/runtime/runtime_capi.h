// C API of the C++ runtime's host-side pieces (libpagedkv_runtime.so): the engine over a HostExecutor (the
// scheduler, the step inputs, the stops), the sampling draws and the block-copy geometry, for ctypes
// (src/pagedkv/runtime/native.py, which builds its mirrors from pagedkv_rt_struct_layouts) and C callers.
// Statuses and errors are the KV manager's (kv_capi.h: pagedkv_kv_status, pagedkv_kv_last_error).
//
// The engine runs on a caller-driven host executor: pagedkv_rt_engine_begin_step schedules the next step and
// writes its engine inputs (a view of them comes back), the caller computes the sampled tokens, and
// pagedkv_rt_engine_end_step commits them — the device's part of a step is the caller's.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "pagedkv/runtime/kv_capi.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PAGEDKV_RT_CAPI_VERSION 1

// What the model computes (executor.h ModelInfo).
typedef struct pagedkv_rt_model_info {
    int32_t vocab, num_top_logprobs, explicit_positions, static_max_blocks, num_layers;
} pagedkv_rt_model_info;

// The engine's configuration (engine.h EngineConfig, scheduler.h SchedulerConfig).
typedef struct pagedkv_rt_engine_config {
    int32_t max_num_seqs, max_num_batched_tokens, chunk_size;
    int32_t preemption;  // 0 recompute, 1 swap
    double watermark;
    int32_t max_model_len;  // 0: what one sequence can hold
    int32_t num_eos;
    const int32_t* eos_token_ids;
    uint64_t seed;
} pagedkv_rt_engine_config;

// One request's sampling parameters (sampling.h SamplingParams).
typedef struct pagedkv_rt_sampling_params {
    int32_t max_new_tokens;  // 0: up to the context limit
    int32_t top_k;
    double temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty;
    int32_t has_seed;
    int32_t logprobs;  // -1: none
    uint64_t seed;
    int32_t ignore_eos;
    int32_t num_stop_token_ids;
    const int32_t* stop_token_ids;
} pagedkv_rt_sampling_params;

// A step begun by pagedkv_rt_engine_begin_step: its shape, the scheduled requests and its engine inputs (the
// engine_io names; valid until the step ends). block_tables[g] is [num_seqs, table_width[g]].
typedef struct pagedkv_rt_step_view {
    int32_t num_seqs, num_tokens, num_rows, penalty_width, num_decodes, num_groups, decode_only;
    const int64_t* request_ids;  // [num_seqs] decodes first, then prefill chunks
    const int32_t* counts;       // [num_seqs] their new tokens
    const int32_t* table_width;  // [num_groups]
    const int64_t* input_ids;    // [num_tokens]
    const int32_t* cu_q_lens;    // [num_seqs + 1]
    const int32_t* past_lens;    // [num_seqs]
    const int32_t* const* block_tables;
    const int32_t* position_ids;    // [num_tokens], NULL without explicit positions
    const int32_t* logits_rows;     // [num_rows]
    const float* sampling_params;   // [num_rows, 8]
    const int32_t* penalty_tokens;  // [num_rows, penalty_width]
    const float* penalty_counts;    // [num_rows, penalty_width]
} pagedkv_rt_step_view;

typedef struct pagedkv_rt_request_info {
    int32_t state;          // 0 waiting, 1 running, 2 swapped, 3 finished
    int32_t finish_reason;  // 0 none, 1 stop, 2 length, 3 abort
    int32_t num_computed, num_output, num_preemptions, max_tokens;
    uint64_t seed, arrival;
} pagedkv_rt_request_info;

typedef struct pagedkv_rt_stats {
    int64_t steps, preemptions, swaps_out, swaps_in, prefix_tokens_reused;
    int32_t waiting, running, swapped, max_model_len;
    double schedule_s, prepare_s, execute_s, finish_s;  // the last step's host seconds (engine.h StepTiming)
} pagedkv_rt_stats;

typedef struct pagedkv_rt_engine pagedkv_rt_engine;

PAGEDKV_KV_EXPORT int32_t pagedkv_rt_capi_version(void);
// Every struct of this API described as JSON (pagedkv/struct_description.h).
PAGEDKV_KV_EXPORT const char* pagedkv_rt_struct_layouts(void);

// ---- sampling draws and copy geometry ----
// u[i] = draw counters[i] of the SplitMix64 stream seeded seeds[i] (float64) and column[i], the sampling_params
// `u` value (clamped below 1, float32); either output may be NULL.
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_uniforms(const uint64_t* seeds, const uint64_t* counters, int64_t n, double* u,
                                              float* column);
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_derive_seeds(uint64_t base, const uint64_t* index, int64_t n, uint64_t* out);
// The memcpy geometry of copying num_tokens tokens (<= 0: all) of one block of `group` (copy_plan.h).
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_copy_plan(const pagedkv_kv_group_desc* group, int32_t num_tokens, int64_t* rows,
                                               int64_t* pitch, int64_t* width);

// ---- the engine over a caller-driven host executor ----
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_engine_create(const pagedkv_kv_group_desc* groups, int32_t num_groups,
                                                   int32_t enable_prefix_reuse, const pagedkv_rt_model_info* model,
                                                   const pagedkv_rt_engine_config* config, pagedkv_rt_engine** out);
PAGEDKV_KV_EXPORT void pagedkv_rt_engine_destroy(pagedkv_rt_engine* engine);
// A handle on the engine's KV manager for the pagedkv_kv_* queries (destroy it before the engine).
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_engine_kv(pagedkv_rt_engine* engine, pagedkv_kv_manager** out);
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_engine_add_request(pagedkv_rt_engine* engine, int64_t id, const int32_t* prompt,
                                                        int32_t prompt_len, const pagedkv_rt_sampling_params* params);
// `found` (may be NULL): 1 when an unfinished request was aborted.
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_engine_abort(pagedkv_rt_engine* engine, int64_t id, int32_t* found);
// Schedule and write the next step; `scheduled` = 0 when there is nothing to run (the view is then untouched).
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_engine_begin_step(pagedkv_rt_engine* engine, int32_t* scheduled,
                                                       pagedkv_rt_step_view* view);
// The step's sampled rows: tokens [num_rows], logprobs [num_rows] and top_* [num_rows * num_top] (NULL: zeros).
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_engine_end_step(pagedkv_rt_engine* engine, const int32_t* tokens,
                                                     const float* logprobs, const int32_t* top_tokens,
                                                     const float* top_logprobs, int32_t num_top);
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_engine_cancel_step(pagedkv_rt_engine* engine);
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_engine_stats(const pagedkv_rt_engine* engine, pagedkv_rt_stats* out);
// A request, unfinished or finished (finished ones stay until pagedkv_rt_engine_release): its info and output
// tokens (`output` [capacity], filled when it fits; info->num_output says how many).
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_engine_request(const pagedkv_rt_engine* engine, int64_t id,
                                                    pagedkv_rt_request_info* info, int32_t* output, int32_t capacity);
// Its logprobs: logprobs [num_output], top_tokens / top_logprobs [num_output * k], k = its params' logprobs.
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_engine_request_logprobs(const pagedkv_rt_engine* engine, int64_t id,
                                                             float* logprobs, int32_t* top_tokens, float* top_logprobs);
// Ids of the requests finished since the last call (count protocol of kv_capi.h: capacity 0 asks; they are
// taken only when capacity >= count).
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_engine_finished(pagedkv_rt_engine* engine, int64_t* ids, int32_t capacity,
                                                     int32_t* count);
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_engine_release(pagedkv_rt_engine* engine, int64_t id);

// ---- deployment checks that need no GPU (trt_engine.h, engine_io_check.h, sizing.h) ----
// Loads TensorRT (dlopen libnvinfer.so.<major>); `description` [capacity] (may be NULL) gets e.g.
// "TensorRT 10.14.1 (libnvinfer.so.10)". PAGEDKV_KV_TENSORRT_UNAVAILABLE, one line, when it cannot.
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_load_tensorrt(char* description, int32_t capacity);
// PAGEDKV_KV_PLUGIN_LIBRARY unless `path` loads and provides the two pagedkv IPluginV3 creators.
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_check_plugin_library(const char* path);
// An engine's `n` I/O tensors against the engine-I/O contract: names, is_input (0/1), types (0 FLOAT, 1 HALF,
// 2 BF16, 3 INT32, 4 INT64, 5 other), ranks and dims [n * 8] (row i: tensor i's dims, < 0 dynamic).
// num_pool_groups: the deploy config's count (< 0: not checked). `model` and `pool_groups` (may be NULL) get what
// the I/O says; PAGEDKV_KV_ENGINE_MISMATCH naming every difference.
#define PAGEDKV_RT_MAX_RANK 8
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_check_engine_io(int32_t n, const char* const* names, const int32_t* is_input,
                                                     const int32_t* types, const int32_t* ranks, const int64_t* dims,
                                                     int32_t num_pool_groups, pagedkv_rt_model_info* model,
                                                     int32_t* pool_groups);
// Blocks per group that fit in budget_bytes -> out [num_groups]; shares [num_shares] split the budget (num_shares
// < 0: none, equal block counts).
PAGEDKV_KV_EXPORT int32_t pagedkv_rt_blocks_for_budget(const pagedkv_kv_group_desc* groups, int32_t num_groups,
                                                       int64_t budget_bytes, const double* shares, int32_t num_shares,
                                                       int64_t* out);

#ifdef __cplusplus
}
#endif
