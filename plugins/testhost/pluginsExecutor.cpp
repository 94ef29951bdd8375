#include "pluginsExecutor.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "common/pluginNames.h"
#include "exprBuilder.h"
#include "pagedkv/step_metadata.h"

namespace testhost {

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::PluginTensorDesc;
using nvinfer1::TensorFormat;
using nvinfer1::TensorRTPhase;
namespace rt = pagedkv::runtime;

namespace {

Dims dims(std::initializer_list<int64_t> values) {
    Dims d{};
    d.nbDims = int32_t(values.size());
    std::copy(values.begin(), values.end(), d.d);
    return d;
}

// The output dims getOutputShapes gives for these (constant) input dims.
std::vector<Dims> outputDims(nvinfer1::IPluginV3OneBuild* build, std::vector<Dims> const& in) {
    HostExprBuilder builder;
    std::vector<DimsExprs> inExprs;
    for (Dims const& d : in) {
        DimsExprs e{};
        e.nbDims = d.nbDims;
        for (int32_t i = 0; i < d.nbDims; ++i) e.d[i] = builder.constant(d.d[i]);
        inExprs.push_back(e);
    }
    int32_t const nbOut = build->getNbOutputs();
    std::vector<DimsExprs> outExprs(nbOut);
    if (build->getOutputShapes(inExprs.data(), int32_t(in.size()), nullptr, 0, outExprs.data(), nbOut, builder) != 0)
        throw std::runtime_error("getOutputShapes failed");
    std::vector<Dims> out(nbOut);
    for (int32_t o = 0; o < nbOut; ++o) {
        out[o].nbDims = outExprs[o].nbDims;
        for (int32_t i = 0; i < outExprs[o].nbDims; ++i) {
            if (outExprs[o].d[i] == nullptr || !builder.owns(outExprs[o].d[i]))
                throw std::runtime_error("getOutputShapes: output " + std::to_string(o) + " has a foreign expression");
            out[o].d[i] = HostExprBuilder::cast(*outExprs[o].d[i]).evaluate({});
        }
    }
    return out;
}

uint16_t toIO(float x, DataType type) {
    uint16_t bits;
    if (type == DataType::kHALF) {
        __half const h = __float2half_rn(x);
        std::memcpy(&bits, &h, 2);
    } else {
        __nv_bfloat16 const b = __float2bfloat16_rn(x);
        std::memcpy(&bits, &b, 2);
    }
    return bits;
}

template <typename T>
void* deviceAlloc(size_t count, char const* what) {
    void* p = nullptr;
    rt::checkCuda(cudaMalloc(&p, std::max<size_t>(count * sizeof(T), 1)), what);
    return p;
}

}  // namespace

PluginsExecutor::Stage PluginsExecutor::makeStage(nvinfer1::IPluginCreatorV3One* creator, Json const& attrs,
                                                  std::vector<Dims> inMin, std::vector<Dims> inMax,
                                                  std::vector<DataType> inTypes) {
    std::string const name = creator->getPluginName();
    Stage s;
    FieldSet fields = FieldSet::fromOnnxAttributes(attrs, creator->getFieldNames());
    s.build.reset(creator->createPlugin("layer", fields.get(), TensorRTPhase::kBUILD));
    if (!s.build) throw std::runtime_error(name + ": createPlugin (build) returned null");
    Capabilities caps = capabilitiesOf(s.build.get());
    if (!caps.build || !caps.runtime) throw std::runtime_error(name + ": missing build or runtime capability");
    int32_t const nbIn = int32_t(inTypes.size()), nbOut = caps.build->getNbOutputs();
    s.inTypes = inTypes;
    s.outTypes.resize(nbOut);
    if (caps.build->getOutputDataTypes(s.outTypes.data(), nbOut, inTypes.data(), nbIn) != 0)
        throw std::runtime_error(name + ": getOutputDataTypes failed");
    std::vector<Dims> const outMin = outputDims(caps.build, inMin), outMax = outputDims(caps.build, inMax);
    // The profile: min / opt / max over the executor's limits; build-time dims -1 where they vary (as TensorRT).
    std::vector<DynamicPluginTensorDesc> io(nbIn + nbOut);
    for (int32_t p = 0; p < nbIn + nbOut; ++p) {
        Dims const& lo = p < nbIn ? inMin[p] : outMin[p - nbIn];
        Dims const& hi = p < nbIn ? inMax[p] : outMax[p - nbIn];
        DynamicPluginTensorDesc& d = io[p];
        d.desc.dims = hi;
        for (int32_t i = 0; i < hi.nbDims; ++i)
            if (lo.d[i] != hi.d[i]) d.desc.dims.d[i] = -1;
        d.desc.type = p < nbIn ? inTypes[p] : s.outTypes[p - nbIn];
        d.desc.format = TensorFormat::kLINEAR;
        d.desc.scale = 1.f;
        d.min = lo;
        d.opt = d.max = hi;
    }
    for (int32_t p = 0; p < nbIn + nbOut; ++p)
        if (!caps.build->supportsFormatCombination(p, io.data(), nbIn, nbOut))
            throw std::runtime_error(name + ": supportsFormatCombination refused position " + std::to_string(p));
    if (caps.build->configurePlugin(io.data(), nbIn, io.data() + nbIn, nbOut) != 0)
        throw std::runtime_error(name + ": configurePlugin failed");
    workspaceBytes_ = std::max(workspaceBytes_, caps.build->getWorkspaceSize(io.data(), nbIn, io.data() + nbIn, nbOut));
    FieldSet serialized = FieldSet::copyOf(caps.runtime->getFieldsToSerialize());
    s.deserialized.reset(creator->createPlugin("layer", serialized.get(), TensorRTPhase::kRUNTIME));
    if (!s.deserialized) throw std::runtime_error(name + ": createPlugin (runtime) returned null");
    HostResourceContext context;
    s.runtime.reset(capabilitiesOf(s.deserialized.get()).runtime->attachToContext(&context));
    s.run = s.runtime ? capabilitiesOf(s.runtime.get()).runtime : nullptr;
    if (!s.run) throw std::runtime_error(name + ": attachToContext returned no runtime plugin");
    s.inDesc.resize(nbIn);
    s.outDesc.resize(nbOut);
    s.inputs.resize(nbIn);
    s.outputs.resize(nbOut);
    s.outMax = outMax;
    return s;
}

PluginsExecutor::PluginsExecutor(PluginLibrary& library, PluginsModel model, std::vector<rt::PoolGroup> groups,
                                 rt::StepLimits limits, rt::DeviceOptions const& options)
    : DeviceExecutor(groups, rt::ModelInfo{model.vocab, 0, false, 0, model.numLayers}, limits, options),
      model_(std::move(model)) {
    int32_t const L = model_.numLayers, W = model_.qkvWidth;
    if (L < 1 || int32_t(model_.writeAttrs.size()) != L || int32_t(model_.attentionAttrs.size()) != L)
        throw std::invalid_argument("plugins model: one write and one attention attribute set per layer");
    if (model_.tokenRows.size() != size_t(L) * model_.vocab * W ||
        model_.positionRows.size() != size_t(L) * model_.maxPosition * W)
        throw std::invalid_argument(
            "plugins model: token_rows / position_rows do not match [L, vocab | max_position, qkv_width]");
    if (groups.size() != 1) throw std::invalid_argument("plugins model: one pool group");
    rt::StepLimits const& lim = this->limits();
    int64_t const T = lim.maxTokens, B = lim.maxSeqs, MB = lim.maxBlocks[0];
    DataType const io = model_.ioType;
    try {
        // The plugins' inputs (their READMEs): QKV write (qkv, kv_pools, block_table, cu_q_lens, past_lens),
        // attention (q, kv_pools, block_table, cu_q_lens, past_lens, kv_write_status).
        DataType const i32 = DataType::kINT32, i64 = DataType::kINT64;
        Dims const pools = dims({1, pagedkv::kPoolDescFields}), status = dims({pagedkv::kStatusFields});
        for (int32_t l = 0; l < L; ++l) {
            std::vector<Dims> lo{dims({1, W}), pools, dims({1, 1}), dims({2}), dims({1})};
            std::vector<Dims> hi{dims({T, W}), pools, dims({B, MB}), dims({B + 1}), dims({B})};
            write_.push_back(makeStage(library.creator(pagedkv::plugin::kQKVWritePluginName), model_.writeAttrs[l],
                                       lo, hi, {io, i64, i32, i32, i32}));
            qWidth_ = int32_t(write_.back().outMax[0].d[1]);  // q [T, H * D]: what the attention reads and writes
            lo[0] = dims({1, qWidth_});
            hi[0] = dims({T, qWidth_});
            lo.push_back(status);
            hi.push_back(status);
            attention_.push_back(makeStage(library.creator(pagedkv::plugin::kAttentionPluginName),
                                           model_.attentionAttrs[l], lo, hi, {io, i64, i32, i32, i32, i32}));
            qkv_.push_back(deviceAlloc<uint16_t>(size_t(T) * W, "cudaMalloc (qkv)"));
            q_.push_back(deviceAlloc<uint16_t>(size_t(T) * qWidth_, "cudaMalloc (q)"));
            out_.push_back(deviceAlloc<uint16_t>(size_t(T) * qWidth_, "cudaMalloc (attention out)"));
        }
        if (workspaceBytes_ > 0) workspace_ = deviceAlloc<char>(workspaceBytes_, "cudaMalloc (workspace)");
        rt::checkCuda(cudaHostAlloc(&qkvStaging_, size_t(L) * T * W * 2, cudaHostAllocDefault), "cudaHostAlloc (qkv)");
    } catch (...) {
        for (auto* list : {&qkv_, &q_, &out_})
            for (void* p : *list) cudaFree(p);
        if (workspace_) cudaFree(workspace_);
        throw;
    }
}

PluginsExecutor::~PluginsExecutor() {
    cudaStreamSynchronize(stream());
    for (auto* list : {&qkv_, &q_, &out_})
        for (void* p : *list) cudaFree(p);
    if (workspace_) cudaFree(workspace_);
    if (qkvStaging_) cudaFreeHost(qkvStaging_);
}

std::vector<Dims> PluginsExecutor::runDims(rt::StepShape const& run, bool attention) const {
    int64_t const T = run.numTokens, B = run.numSeqs;
    std::vector<Dims> d{dims({T, attention ? qWidth_ : model_.qkvWidth}), dims({1, pagedkv::kPoolDescFields}),
                        dims({B, run.tableWidth[0]}), dims({B + 1}), dims({B})};
    if (attention) d.push_back(dims({pagedkv::kStatusFields}));
    return d;
}

void PluginsExecutor::setShapes(rt::StepShape const& run) {
    // The model's QKV rows of this launch (padding rows included) -> the fixed buffers the plugins read.
    rt::StepInputBuffers const& in = hostInputs();
    int32_t const L = model_.numLayers, W = model_.qkvWidth, T = run.numTokens;
    auto* staging = static_cast<uint16_t*>(qkvStaging_);
    for (int32_t b = 0; b < run.numSeqs; ++b) {
        for (int32_t t = in.cuQLens[b]; t < in.cuQLens[b + 1]; ++t) {
            int64_t const id = in.inputIds[t];
            int32_t const position = in.pastLens[b] + (t - in.cuQLens[b]);
            if (id < 0 || id >= model_.vocab || position >= model_.maxPosition)
                throw std::out_of_range("plugins model: token " + std::to_string(id) + " at position " +
                                        std::to_string(position) + " is outside its tables");
            for (int32_t l = 0; l < L; ++l) {
                float const* tok = &model_.tokenRows[(size_t(l) * model_.vocab + id) * W];
                float const* pos = &model_.positionRows[(size_t(l) * model_.maxPosition + position) * W];
                uint16_t* row = staging + (size_t(l) * limits().maxTokens + t) * W;
                for (int32_t c = 0; c < W; ++c) row[c] = toIO(tok[c] + pos[c], model_.ioType);
            }
        }
    }
    for (int32_t l = 0; l < L; ++l)
        rt::checkCuda(cudaMemcpyAsync(qkv_[l], staging + size_t(l) * limits().maxTokens * W, size_t(T) * W * 2,
                                      cudaMemcpyHostToDevice, stream()),
                      "upload qkv");
    // Each plugin's tensors at this launch's shape and addresses (a bucket always packs to the same ones).
    void* const pools = reinterpret_cast<void*>(kvPoolsDevice());
    void* const table = inputDevice(inSlot.blockTables[0]);
    void* const cu = inputDevice(inSlot.cuQLens);
    void* const past = inputDevice(inSlot.pastLens);
    std::vector<Dims> const wDims = runDims(run, false), aDims = runDims(run, true);
    for (int32_t l = 0; l < L; ++l) {
        Stage& w = write_[l];
        Stage& a = attention_[l];
        w.inputs = {qkv_[l], pools, table, cu, past};
        w.outputs = {q_[l], outputDevice(outSlot.statuses[l])};
        a.inputs = {q_[l], pools, table, cu, past, outputDevice(outSlot.statuses[l])};
        a.outputs = {out_[l]};
        for (Stage* s : {&w, &a}) {
            std::vector<Dims> const& d = s == &w ? wDims : aDims;
            for (size_t p = 0; p < d.size(); ++p)
                s->inDesc[p] = PluginTensorDesc{d[p], s->inTypes[p], TensorFormat::kLINEAR, 1.f};
        }
        w.outDesc[0] = PluginTensorDesc{dims({T, qWidth_}), w.outTypes[0], TensorFormat::kLINEAR, 1.f};
        w.outDesc[1] = PluginTensorDesc{dims({pagedkv::kStatusFields}), w.outTypes[1], TensorFormat::kLINEAR, 1.f};
        a.outDesc[0] = PluginTensorDesc{dims({T, qWidth_}), a.outTypes[0], TensorFormat::kLINEAR, 1.f};
        for (Stage* s : {&w, &a})
            if (s->run->onShapeChange(s->inDesc.data(), int32_t(s->inDesc.size()), s->outDesc.data(),
                                      int32_t(s->outDesc.size())) != 0)
                throw std::runtime_error("layer " + std::to_string(l) + ": onShapeChange failed");
    }
}

void PluginsExecutor::enqueue(rt::StepShape const& run) {
    (void)run;
    ++lastEnqueues_;
    for (int32_t l = 0; l < model_.numLayers; ++l) {
        for (Stage* s : {&write_[l], &attention_[l]}) {
            if (s->run->enqueue(s->inDesc.data(), s->outDesc.data(), s->inputs.data(), s->outputs.data(), workspace_,
                                stream()) != 0)
                throw std::runtime_error("layer " + std::to_string(l) + ": " +
                                         (s == &write_[l] ? "write" : "attention") + " plugin enqueue failed");
        }
    }
}

rt::StepOutputs PluginsExecutor::execute(rt::StepShape const& shape) {
    lastEnqueues_ = 0;
    return DeviceExecutor::execute(shape);
}

rt::StepOutputs PluginsExecutor::results(rt::StepShape const& run) {
    // The sampling head: logits row r stands for token t = logits_rows[r]; next = (id[t] * 7 + t * 3 + 5) % vocab.
    rt::StepInputBuffers const& in = hostInputs();
    tokens_.assign(run.numRows, 0);
    logprobs_.assign(run.numRows, 0.f);
    for (int32_t r = 0; r < run.numRows; ++r) {
        int64_t const t = in.logitsRows[r];
        tokens_[r] = int32_t((in.inputIds[t] * 7 + t * 3 + 5) % model_.vocab);
    }
    return {tokens_.data(), logprobs_.data(), nullptr, nullptr, 0};
}

std::vector<uint16_t> PluginsExecutor::read(void const* device, int32_t rows) const {
    std::vector<uint16_t> host(size_t(rows) * qWidth_);
    rt::checkCuda(cudaMemcpy(host.data(), device, host.size() * 2, cudaMemcpyDeviceToHost), "read plugin output");
    return host;
}

std::vector<uint16_t> PluginsExecutor::readQ(int32_t layer, int32_t rows) const { return read(q_.at(layer), rows); }
std::vector<uint16_t> PluginsExecutor::readOut(int32_t layer, int32_t rows) const { return read(out_.at(layer), rows); }

}  // namespace testhost
