// extern "C" entries of the runtime's host-side pieces (runtime_capi.h): the engine over a caller-driven
// HostExecutor, the SplitMix64 draws, the copy geometry, the deployment checks. Errors go through capi_guard.h.
#include "pagedkv/runtime/runtime_capi.h"

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "capi_guard.h"
#include "pagedkv/runtime/copy_plan.h"
#include "pagedkv/runtime/engine.h"
#include "pagedkv/runtime/engine_io_check.h"
#include "pagedkv/runtime/sizing.h"
#include "pagedkv/runtime/trt_engine.h"
#include "pagedkv/struct_description.h"

using namespace pagedkv;
using namespace pagedkv::runtime;
using namespace pagedkv::runtime::capi;

struct pagedkv_rt_engine {
    std::unique_ptr<HostExecutor> executor;
    std::unique_ptr<Engine> engine;
    std::map<RequestId, std::unique_ptr<Request>> finished;  // until pagedkv_rt_engine_release
    std::vector<RequestId> newlyFinished;
    // the view of the step in flight
    std::vector<int64_t> ids;
    std::vector<int32_t> counts;
    std::vector<int32_t const*> tables;
    StepInputBuffers inputs;  // the executor's buffers of the step
};

namespace {

SamplingParams paramsOf(pagedkv_rt_sampling_params const& p) {
    SamplingParams s;
    s.maxNewTokens = p.max_new_tokens > 0 ? std::optional<int32_t>(p.max_new_tokens) : std::nullopt;
    s.temperature = p.temperature;
    s.topK = p.top_k;
    s.topP = p.top_p;
    s.minP = p.min_p;
    s.repetitionPenalty = p.repetition_penalty;
    s.presencePenalty = p.presence_penalty;
    s.frequencyPenalty = p.frequency_penalty;
    if (p.has_seed) s.seed = p.seed;
    if (p.logprobs >= 0) s.logprobs = p.logprobs;
    if (p.num_stop_token_ids > 0) {
        need(p.stop_token_ids, "stop_token_ids");
        s.stopTokenIds.assign(p.stop_token_ids, p.stop_token_ids + p.num_stop_token_ids);
    }
    s.ignoreEos = p.ignore_eos != 0;
    return s;
}

template <typename F>
int32_t onEngine(pagedkv_rt_engine* e, F&& body) {
    return guarded([&] {
        need(e, "engine");
        body(*e);
    });
}

// Moves what the engine finished into the handle's map (they stay queryable until released).
void collect(pagedkv_rt_engine& e) {
    for (auto& r : e.engine->takeFinished()) {
        e.newlyFinished.push_back(r->id);
        e.finished[r->id] = std::move(r);
    }
}

Request const& requestOf(pagedkv_rt_engine const& e, int64_t id) {
    if (Request const* r = e.engine->find(id)) return *r;
    auto it = e.finished.find(id);
    if (it == e.finished.end())
        throw KVArgumentError("request " + std::to_string(id) + ": not in the engine (unknown or released)", std::nullopt);
    return *it->second;
}

// The C API's structs, described for ctypes (checked where pagedkv_rt_struct_layouts describes them).
using structdesc::FieldDesc;
#define M(f) PKV_FIELD(pagedkv_rt_model_info, f)
constexpr FieldDesc kModelInfo[] = {M(vocab), M(num_top_logprobs), M(explicit_positions), M(static_max_blocks),
                                    M(num_layers)};
#undef M
#define C(f) PKV_FIELD(pagedkv_rt_engine_config, f)
constexpr FieldDesc kEngineConfig[] = {C(max_num_seqs), C(max_num_batched_tokens), C(chunk_size), C(preemption),
                                       C(watermark),    C(max_model_len),          C(num_eos),    C(eos_token_ids),
                                       C(seed)};
#undef C
#define S(f) PKV_FIELD(pagedkv_rt_sampling_params, f)
constexpr FieldDesc kSamplingParams[] = {S(max_new_tokens),    S(top_k),           S(temperature),
                                         S(top_p),             S(min_p),           S(repetition_penalty),
                                         S(presence_penalty),  S(frequency_penalty), S(has_seed),
                                         S(logprobs),          S(seed),            S(ignore_eos),
                                         S(num_stop_token_ids), S(stop_token_ids)};
#undef S
#define V(f) PKV_FIELD(pagedkv_rt_step_view, f)
constexpr FieldDesc kStepView[] = {V(num_seqs),       V(num_tokens),   V(num_rows),        V(penalty_width),
                                   V(num_decodes),    V(num_groups),   V(decode_only),     V(request_ids),
                                   V(counts),         V(table_width),  V(input_ids),       V(cu_q_lens),
                                   V(past_lens),      V(block_tables), V(position_ids),    V(logits_rows),
                                   V(sampling_params), V(penalty_tokens), V(penalty_counts)};
#undef V
#define R(f) PKV_FIELD(pagedkv_rt_request_info, f)
constexpr FieldDesc kRequestInfo[] = {R(state),      R(finish_reason),   R(num_computed), R(num_output),
                                      R(num_preemptions), R(max_tokens), R(seed),         R(arrival)};
#undef R
#define T(f) PKV_FIELD(pagedkv_rt_stats, f)
constexpr FieldDesc kStats[] = {T(steps),   T(preemptions), T(swaps_out),     T(swaps_in),   T(prefix_tokens_reused),
                                T(waiting), T(running),     T(swapped),       T(max_model_len), T(schedule_s),
                                T(prepare_s), T(execute_s), T(finish_s)};
#undef T
}  // namespace

extern "C" {

int32_t pagedkv_rt_capi_version(void) { return PAGEDKV_RT_CAPI_VERSION; }

const char* pagedkv_rt_struct_layouts(void) {
    static std::string const json = structdesc::describeStructs(
        {PKV_DESCRIBE(pagedkv_rt_model_info, kModelInfo), PKV_DESCRIBE(pagedkv_rt_engine_config, kEngineConfig),
         PKV_DESCRIBE(pagedkv_rt_sampling_params, kSamplingParams), PKV_DESCRIBE(pagedkv_rt_step_view, kStepView),
         PKV_DESCRIBE(pagedkv_rt_request_info, kRequestInfo), PKV_DESCRIBE(pagedkv_rt_stats, kStats)});
    return json.c_str();
}

int32_t pagedkv_rt_uniforms(const uint64_t* seeds, const uint64_t* counters, int64_t n, double* u, float* column) {
    return guarded([&] {
        if (n <= 0) return;
        need(seeds, "seeds");
        need(counters, "counters");
        for (int64_t i = 0; i < n; ++i) {
            if (u) u[i] = uniformDraw(seeds[i], counters[i]);
            if (column) column[i] = samplingUniform(seeds[i], counters[i]);
        }
    });
}

int32_t pagedkv_rt_derive_seeds(uint64_t base, const uint64_t* index, int64_t n, uint64_t* out) {
    return guarded([&] {
        if (n <= 0) return;
        need(index, "index");
        need(out, "out");
        for (int64_t i = 0; i < n; ++i) out[i] = deriveSeed(base, index[i]);
    });
}

int32_t pagedkv_rt_copy_plan(const pagedkv_kv_group_desc* group, int32_t num_tokens, int64_t* rows, int64_t* pitch,
                             int64_t* width) {
    return guarded([&] {
        need(group, "group");
        PoolGroup const spec = readGroupDescs(group, 1).groups[0];
        CopyPlan const p = copyPlan(spec.layout, spec.itemsize(), num_tokens);
        if (rows) *rows = p.rows;
        if (pitch) *pitch = p.pitch;
        if (width) *width = p.width;
    });
}

int32_t pagedkv_rt_engine_create(const pagedkv_kv_group_desc* groups, int32_t num_groups, int32_t enable_prefix_reuse,
                                 const pagedkv_rt_model_info* model, const pagedkv_rt_engine_config* config,
                                 pagedkv_rt_engine** out) {
    return guarded([&] {
        need(out, "out");
        *out = nullptr;
        need(model, "model");
        need(config, "config");
        GroupDescs g = readGroupDescs(groups, num_groups);
        ModelInfo info;
        info.vocab = model->vocab;
        info.numTopLogprobs = model->num_top_logprobs;
        info.explicitPositions = model->explicit_positions != 0;
        info.staticMaxBlocks = model->static_max_blocks;
        info.numLayers = model->num_layers;
        EngineConfig cfg;
        cfg.scheduler.maxNumSeqs = config->max_num_seqs;
        cfg.scheduler.maxNumBatchedTokens = config->max_num_batched_tokens;
        cfg.scheduler.chunkSize = config->chunk_size;
        cfg.scheduler.preemption = Preemption(config->preemption);
        cfg.scheduler.watermark = config->watermark;
        if (config->max_model_len > 0) cfg.maxModelLen = config->max_model_len;
        if (config->num_eos > 0) {
            need(config->eos_token_ids, "eos_token_ids");
            cfg.eosTokenIds.assign(config->eos_token_ids, config->eos_token_ids + config->num_eos);
        }
        cfg.seed = config->seed;
        auto e = std::make_unique<pagedkv_rt_engine>();
        e->executor = std::make_unique<HostExecutor>(
            KVManager(std::move(g.groups), g.numBlocks, g.hostBlocks, enable_prefix_reuse != 0), info);
        e->engine = std::make_unique<Engine>(*e->executor, std::move(cfg));
        *out = e.release();
    });
}

void pagedkv_rt_engine_destroy(pagedkv_rt_engine* engine) { delete engine; }

int32_t pagedkv_rt_engine_kv(pagedkv_rt_engine* engine, pagedkv_kv_manager** out) {
    return onEngine(engine, [&](pagedkv_rt_engine& e) {
        need(out, "out");
        auto handle = std::make_unique<pagedkv_kv_manager>();
        handle->manager = &e.executor->kv();
        *out = handle.release();
    });
}

int32_t pagedkv_rt_engine_add_request(pagedkv_rt_engine* engine, int64_t id, const int32_t* prompt, int32_t prompt_len,
                                      const pagedkv_rt_sampling_params* params) {
    return onEngine(engine, [&](pagedkv_rt_engine& e) {
        need(params, "params");
        if (prompt_len > 0) need(prompt, "prompt");
        std::vector<int32_t> tokens(prompt, prompt + std::max(0, prompt_len));
        if (e.finished.count(id))
            throw std::invalid_argument("request " + std::to_string(id) +
                                        ": a finished request with this id is not released yet");
        e.engine->addRequest(id, std::move(tokens), paramsOf(*params));
    });
}

int32_t pagedkv_rt_engine_abort(pagedkv_rt_engine* engine, int64_t id, int32_t* found) {
    return onEngine(engine, [&](pagedkv_rt_engine& e) {
        bool const aborted = e.engine->abort(id);
        if (found) *found = aborted ? 1 : 0;
        collect(e);
    });
}

int32_t pagedkv_rt_engine_begin_step(pagedkv_rt_engine* engine, int32_t* scheduled, pagedkv_rt_step_view* view) {
    return onEngine(engine, [&](pagedkv_rt_engine& e) {
        need(scheduled, "scheduled");
        need(view, "view");
        *scheduled = 0;
        if (!e.engine->beginStep()) return;
        *scheduled = 1;
        StepShape const& shape = e.engine->stepShape();
        e.inputs = e.executor->buffers();
        ScheduledStep const& plan = e.engine->scheduledStep();
        e.ids.clear();
        e.counts.clear();
        for (Request const* r : plan.decodes) {
            e.ids.push_back(r->id);
            e.counts.push_back(1);
        }
        for (auto const& [r, n] : plan.prefills) {
            e.ids.push_back(r->id);
            e.counts.push_back(n);
        }
        e.tables.assign(e.inputs.blockTables.begin(), e.inputs.blockTables.end());
        *view = pagedkv_rt_step_view{shape.numSeqs,
                                     shape.numTokens,
                                     shape.numRows,
                                     shape.penaltyWidth,
                                     int32_t(plan.decodes.size()),
                                     int32_t(shape.tableWidth.size()),
                                     shape.decodeOnly ? 1 : 0,
                                     e.ids.data(),
                                     e.counts.data(),
                                     shape.tableWidth.data(),
                                     e.inputs.inputIds,
                                     e.inputs.cuQLens,
                                     e.inputs.pastLens,
                                     e.tables.data(),
                                     e.inputs.positionIds,
                                     e.inputs.logitsRows,
                                     e.inputs.samplingParams,
                                     e.inputs.penaltyTokens,
                                     e.inputs.penaltyCounts};
    });
}

int32_t pagedkv_rt_engine_end_step(pagedkv_rt_engine* engine, const int32_t* tokens, const float* logprobs,
                                   const int32_t* top_tokens, const float* top_logprobs, int32_t num_top) {
    return onEngine(engine, [&](pagedkv_rt_engine& e) {
        need(tokens, "tokens");
        int32_t const R = e.engine->stepShape().numRows;
        std::vector<float> zeros(size_t(R) * std::max(1, num_top), 0.f);
        std::vector<int32_t> noTokens(size_t(R) * std::max(1, num_top), 0);
        StepOutputs out{tokens, logprobs ? logprobs : zeros.data(), top_tokens ? top_tokens : noTokens.data(),
                        top_logprobs ? top_logprobs : zeros.data(), num_top};
        e.engine->endStep(out);
        collect(e);
    });
}

int32_t pagedkv_rt_engine_cancel_step(pagedkv_rt_engine* engine) {
    return onEngine(engine, [&](pagedkv_rt_engine& e) { e.engine->cancelStep(); });
}

int32_t pagedkv_rt_engine_stats(const pagedkv_rt_engine* engine, pagedkv_rt_stats* out) {
    return guarded([&] {
        need(engine, "engine");
        need(out, "out");
        Scheduler const& s = engine->engine->scheduler();
        SchedulerStats const& st = s.stats();
        StepTiming const& t = engine->engine->timing();
        *out = pagedkv_rt_stats{st.steps,
                                st.preemptions,
                                st.swapsOut,
                                st.swapsIn,
                                st.prefixTokensReused,
                                int32_t(s.waiting().size()),
                                int32_t(s.running().size()),
                                int32_t(s.swapped().size()),
                                engine->engine->maxModelLen(),
                                t.schedule,
                                t.prepare,
                                t.execute,
                                t.finish};
    });
}

int32_t pagedkv_rt_engine_request(const pagedkv_rt_engine* engine, int64_t id, pagedkv_rt_request_info* info,
                                  int32_t* output, int32_t capacity) {
    return guarded([&] {
        need(engine, "engine");
        need(info, "info");
        Request const& r = requestOf(*engine, id);
        *info = pagedkv_rt_request_info{int32_t(r.state), int32_t(r.finishReason), r.numComputed,
                                        int32_t(r.output.size()), r.numPreemptions, r.maxTokens, r.seed, r.arrival};
        if (output && capacity >= int32_t(r.output.size())) std::copy(r.output.begin(), r.output.end(), output);
    });
}

int32_t pagedkv_rt_engine_request_logprobs(const pagedkv_rt_engine* engine, int64_t id, float* logprobs,
                                           int32_t* top_tokens, float* top_logprobs) {
    return guarded([&] {
        need(engine, "engine");
        Request const& r = requestOf(*engine, id);
        int32_t const k = r.params.logprobs ? *r.params.logprobs : 0;
        for (size_t i = 0; i < r.logprobs.size(); ++i) {
            TokenLogprobs const& lp = r.logprobs[i];
            if (logprobs) logprobs[i] = lp.logprob;
            for (int32_t j = 0; j < k; ++j) {
                if (top_tokens) top_tokens[i * k + j] = lp.top[j].first;
                if (top_logprobs) top_logprobs[i * k + j] = lp.top[j].second;
            }
        }
    });
}

int32_t pagedkv_rt_engine_finished(pagedkv_rt_engine* engine, int64_t* ids, int32_t capacity, int32_t* count) {
    return onEngine(engine, [&](pagedkv_rt_engine& e) {
        need(count, "count");
        *count = int32_t(e.newlyFinished.size());
        if (capacity < *count || e.newlyFinished.empty()) return;
        need(ids, "ids");
        std::copy(e.newlyFinished.begin(), e.newlyFinished.end(), ids);
        e.newlyFinished.clear();
    });
}

int32_t pagedkv_rt_engine_release(pagedkv_rt_engine* engine, int64_t id) {
    return onEngine(engine, [&](pagedkv_rt_engine& e) {
        if (!e.finished.erase(id))
            throw KVArgumentError("release: request " + std::to_string(id) + " is not a finished request", std::nullopt);
    });
}

}  // extern "C"

int32_t pagedkv_rt_load_tensorrt(char* description, int32_t capacity) {
    return guarded([&] {
        std::string const text = loadTensorRT();
        if (description && capacity > 0) {
            size_t const n = std::min(text.size(), size_t(capacity - 1));
            std::copy_n(text.data(), n, description);
            description[n] = '\0';
        }
    });
}

int32_t pagedkv_rt_check_plugin_library(const char* path) {
    return guarded([&] {
        need(path, "path");
        checkPluginLibrary(path);
    });
}

int32_t pagedkv_rt_check_engine_io(int32_t n, const char* const* names, const int32_t* is_input, const int32_t* types,
                                   const int32_t* ranks, const int64_t* dims, int32_t num_pool_groups,
                                   pagedkv_rt_model_info* model, int32_t* pool_groups) {
    return guarded([&] {
        std::vector<EngineTensor> tensors;
        if (n > 0) {
            for (auto [p, what] : {std::pair<void const*, char const*>{names, "names"}, {is_input, "is_input"},
                                   {types, "types"}, {ranks, "ranks"}, {dims, "dims"}})
                need(p, what);
        }
        for (int32_t i = 0; i < n; ++i) {
            need(names[i], "names[i]");
            if (ranks[i] < 0 || ranks[i] > PAGEDKV_RT_MAX_RANK)
                throw std::invalid_argument(std::string(names[i]) + ": rank " + std::to_string(ranks[i]) +
                                            " outside [0, " + std::to_string(PAGEDKV_RT_MAX_RANK) + "]");
            EngineTensor t;
            t.name = names[i];
            t.isInput = is_input[i] != 0;
            t.type = types[i] >= 0 && types[i] < int32_t(TensorType::kOther) ? TensorType(types[i]) : TensorType::kOther;
            t.dims.assign(dims + int64_t(i) * PAGEDKV_RT_MAX_RANK, dims + int64_t(i) * PAGEDKV_RT_MAX_RANK + ranks[i]);
            tensors.push_back(std::move(t));
        }
        EngineIO const io = checkEngineIO(tensors, num_pool_groups, "the engine");
        if (model)
            *model = pagedkv_rt_model_info{io.model.vocab, io.model.numTopLogprobs, io.model.explicitPositions ? 1 : 0,
                                           io.model.staticMaxBlocks, io.model.numLayers};
        if (pool_groups) *pool_groups = io.numPoolGroups;
    });
}

int32_t pagedkv_rt_blocks_for_budget(const pagedkv_kv_group_desc* groups, int32_t num_groups, int64_t budget_bytes,
                                     const double* shares, int32_t num_shares, int64_t* out) {
    return guarded([&] {
        need(out, "out");
        std::vector<PoolGroup> const specs = readGroupDescs(groups, num_groups).groups;
        std::vector<double> split;
        if (num_shares > 0) need(shares, "shares");
        if (num_shares > 0) split.assign(shares, shares + num_shares);
        std::vector<int64_t> const counts = blocksForBudget(specs, budget_bytes, split);
        std::copy(counts.begin(), counts.end(), out);
    });
}
