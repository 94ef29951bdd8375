// TensorRT at run time (trt_engine.h): the loader, the plugin-library check and the TensorRT executor. Written
// against TensorRT 10.14's public headers; every TensorRT object is reached through the inline methods of
// NvInferRuntime.h, so only the two C entries below are looked up. Not run where it was written (no TensorRT).
#include <NvInferRuntime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <set>

#include "common/pluginNames.h"
#include "pagedkv/engine_io.h"
#include "pagedkv/runtime/trt_engine.h"
#include "pagedkv/step_metadata.h"

namespace pagedkv::runtime {

TensorRTUnavailable::~TensorRTUnavailable() = default;
PluginLibraryError::~PluginLibraryError() = default;

namespace {

using nvinfer1::DataType;
using nvinfer1::Dims;

// Records TensorRT's errors and warnings for the messages of our exceptions (nothing is printed).
class Logger final : public nvinfer1::ILogger {
public:
    void log(Severity severity, nvinfer1::AsciiChar const* msg) noexcept override {
        if (severity > Severity::kWARNING) return;
        try {
            std::lock_guard<std::mutex> lock(mutex_);
            messages_.emplace_back(msg ? msg : "");
        } catch (...) {
        }
    }
    std::string take() {  // the messages since the last call, "; "-separated
        std::lock_guard<std::mutex> lock(mutex_);
        std::string out;
        for (auto const& m : messages_) out += (out.empty() ? "" : "; ") + m;
        messages_.clear();
        return out;
    }

private:
    std::mutex mutex_;
    std::vector<std::string> messages_;
};

struct Library {
    void* handle = nullptr;
    void* (*createRuntime)(void* logger, int32_t version) = nullptr;  // createInferRuntime_INTERNAL
    int32_t version = 0;                                                // getInferLibVersion()
    std::string description;
    Logger logger;
};

Library& library() {
    static Library* lib = [] {
        auto l = std::make_unique<Library>();  // (never unloaded: engines may outlive any owner)
        std::string const name = "libnvinfer.so." + std::to_string(NV_TENSORRT_MAJOR);
        l->handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (!l->handle) {
            std::string why = dlerror();
            for (int major : {10, 11, 12}) {  // another major: name it (its ABI is not these headers')
                if (major == NV_TENSORRT_MAJOR) continue;
                std::string const other = "libnvinfer.so." + std::to_string(major);
                if (void* h = dlopen(other.c_str(), RTLD_LAZY | RTLD_LOCAL)) {
                    dlclose(h);
                    throw TensorRTUnavailable("TensorRT not found: " + name + " is missing but " + other +
                                              " (TensorRT " + std::to_string(major) + ") is there; this runtime is "
                                              "built against TensorRT " + std::to_string(NV_TENSORRT_MAJOR) + "." +
                                              std::to_string(NV_TENSORRT_MINOR) + "'s headers: rebuild it against "
                                              "TensorRT " + std::to_string(major) + "'s (TENSORRT_ROOT)");
                }
            }
            throw TensorRTUnavailable("TensorRT not found: cannot load " + name + " (" + why +
                                      "); install TensorRT " + std::to_string(NV_TENSORRT_MAJOR) +
                                      " and put its lib directory on LD_LIBRARY_PATH");
        }
        l->createRuntime = reinterpret_cast<void* (*)(void*, int32_t)>(dlsym(l->handle, "createInferRuntime_INTERNAL"));
        auto version = reinterpret_cast<int32_t (*)()>(dlsym(l->handle, "getInferLibVersion"));
        if (!l->createRuntime || !version)
            throw TensorRTUnavailable("TensorRT not found: " + name + " lacks createInferRuntime_INTERNAL / "
                                      "getInferLibVersion (not TensorRT's libnvinfer?)");
        l->version = version();
        int32_t const major = l->version / 10000, minor = l->version / 100 % 100, patch = l->version % 100;
        if (major != NV_TENSORRT_MAJOR)
            throw TensorRTUnavailable("TensorRT not found: " + name + " reports version " + std::to_string(l->version) +
                                      ", not TensorRT " + std::to_string(NV_TENSORRT_MAJOR));
        l->description = "TensorRT " + std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch) +
                         " (" + name + ")";
        return l.release();
    }();
    return *lib;
}

TensorType typeOf(DataType t) {
    switch (t) {
        case DataType::kFLOAT: return TensorType::kFloat32;
        case DataType::kHALF: return TensorType::kFloat16;
        case DataType::kBF16: return TensorType::kBFloat16;
        case DataType::kINT32: return TensorType::kInt32;
        case DataType::kINT64: return TensorType::kInt64;
        default: return TensorType::kOther;
    }
}

Dims dims(std::initializer_list<int64_t> values) {
    Dims d{};
    d.nbDims = int32_t(values.size());
    std::copy(values.begin(), values.end(), d.d);
    return d;
}

std::string thisGpu() {
    int device = 0;
    cudaDeviceProp prop{};
    if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess)
        return "(no CUDA device)";
    return std::string(prop.name) + ", sm_" + std::to_string(prop.major) + std::to_string(prop.minor);
}

std::vector<char> readFile(std::string const& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("engine " + path + ": cannot open it");
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (bytes.empty()) throw std::runtime_error("engine " + path + ": the file is empty");
    return bytes;
}

template <typename T>
struct Deleter {
    void operator()(T* p) const { delete p; }
};
template <typename T>
using Owned = std::unique_ptr<T, Deleter<T>>;

// The deserialized engine and what its I/O says, before the executor exists (the base class needs the limits).
struct Opened {
    Owned<nvinfer1::IRuntime> runtime;
    Owned<nvinfer1::ICudaEngine> engine;
    EngineIO io;
    StepLimits limits;
};

Opened openEngine(TensorRTOptions const& o) {
    Library& lib = library();
    Opened out;
    lib.logger.take();
    out.runtime.reset(static_cast<nvinfer1::IRuntime*>(lib.createRuntime(&lib.logger, NV_TENSORRT_VERSION)));
    if (!out.runtime) throw TensorRTUnavailable("TensorRT: createInferRuntime failed: " + lib.logger.take());
    if (!out.runtime->getPluginRegistry().loadLibrary(o.pluginLibrary.c_str()))
        throw PluginLibraryError("plugin library " + o.pluginLibrary + ": TensorRT's IPluginRegistry::loadLibrary "
                                 "refused it: " + lib.logger.take());
    std::vector<char> const blob = readFile(o.engine);
    out.engine.reset(out.runtime->deserializeCudaEngine(blob.data(), blob.size()));
    if (!out.engine) {
        std::string const log = lib.logger.take();
        auto says = [&log](char const* word) { return log.find(word) != std::string::npos; };
        if (says("compute capability") || says("incompatible device") || says("different device") ||
            says("this GPU") || says("device type"))
            throw EngineMismatchError("engine " + o.engine + " was built for another GPU (this one: " + thisGpu() +
                                      "); rebuild it here with `pagedkv build`. TensorRT: " + log);
        if (says("version"))
            throw EngineMismatchError("engine " + o.engine + " was built with another TensorRT version (this one: " +
                                      lib.description + "); rebuild it. TensorRT: " + log);
        throw EngineMismatchError("engine " + o.engine + ": TensorRT could not deserialize it: " + log);
    }
    nvinfer1::ICudaEngine& e = *out.engine;
    std::vector<EngineTensor> tensors;
    for (int32_t i = 0; i < e.getNbIOTensors(); ++i) {
        char const* name = e.getIOTensorName(i);
        EngineTensor t;
        t.name = name;
        t.isInput = e.getTensorIOMode(name) == nvinfer1::TensorIOMode::kINPUT;
        t.type = typeOf(e.getTensorDataType(name));
        Dims const d = e.getTensorShape(name);
        t.dims.assign(d.d, d.d + std::max(0, d.nbDims));
        tensors.push_back(std::move(t));
    }
    out.io = checkEngineIO(tensors, int32_t(o.groups.size()), "engine " + o.engine);
    auto maxDim = [&](char const* name, int32_t dim) {
        Dims const d = e.getProfileShape(name, 0, nvinfer1::OptProfileSelector::kMAX);
        return d.nbDims > dim ? int32_t(d.d[dim]) : 0;
    };
    out.limits.maxTokens = maxDim(engine_io::kInputIds, 1);
    out.limits.maxSeqs = maxDim(engine_io::kPastLens, 0);
    out.limits.maxRows = maxDim(engine_io::kLogitsRows, 0);
    out.limits.maxPenaltyWidth = maxDim(engine_io::kPenaltyTokens, 1);
    for (int32_t g = 0; g < out.io.numPoolGroups; ++g) {
        std::string const name = std::string(engine_io::kBlockTablePrefix) + std::to_string(g);
        out.limits.maxBlocks.push_back(out.io.model.staticMaxBlocks ? out.io.model.staticMaxBlocks
                                                                     : maxDim(name.c_str(), 1));
    }
    return out;
}

class TrtExecutor final : public DeviceExecutor {
public:
    TrtExecutor(Opened opened, TensorRTOptions const& o)
        : DeviceExecutor(o.groups, opened.io.model, opened.limits, o.device),
          runtime_(std::move(opened.runtime)),
          engine_(std::move(opened.engine)) {
        context_.reset(engine_->createExecutionContext());
        if (!context_)
            throw std::runtime_error("engine " + o.engine + ": createExecutionContext failed: " + library().logger.take());
        // The logits (only read by a caller that asks for them; the sampling head consumes them on the device):
        // R <= B rows, so one buffer sized for the profile's sequences is enough and never moves.
        int64_t const itemsize = opened.io.logitsType == TensorType::kFloat32 ? 4 : 2;
        checkCuda(cudaMalloc(&logits_, size_t(limits().maxSeqs) * model().vocab * itemsize), "cudaMalloc (logits)");
    }
    ~TrtExecutor() override {
        cudaStreamSynchronize(stream());
        context_.reset();
        if (logits_) cudaFree(logits_);
    }

protected:
    void setShapes(StepShape const& s) override {
        int64_t const T = s.numTokens, B = s.numSeqs, R = s.numRows, W = s.penaltyWidth;
        bind(engine_io::kKvPools, reinterpret_cast<void*>(kvPoolsDevice()),
             dims({int64_t(kv().numGroups()), kPoolDescFields}));
        bind(engine_io::kInputIds, inputDevice(inSlot.inputIds), dims({1, T}));
        bind(engine_io::kCuQLens, inputDevice(inSlot.cuQLens), dims({B + 1}));
        bind(engine_io::kPastLens, inputDevice(inSlot.pastLens), dims({B}));
        for (size_t g = 0; g < inSlot.blockTables.size(); ++g)
            bind(inputs().name(inSlot.blockTables[g]).c_str(), inputDevice(inSlot.blockTables[g]),
                 dims({B, s.tableWidth[g]}));
        if (inSlot.positionIds >= 0) bind(engine_io::kPositionIds, inputDevice(inSlot.positionIds), dims({T}));
        bind(engine_io::kLogitsRows, inputDevice(inSlot.logitsRows), dims({R}));
        bind(engine_io::kSamplingParams, inputDevice(inSlot.samplingParams), dims({R, engine_io::kSamplingFields}));
        bind(engine_io::kPenaltyTokens, inputDevice(inSlot.penaltyTokens), dims({R, W}));
        bind(engine_io::kPenaltyCounts, inputDevice(inSlot.penaltyCounts), dims({R, W}));
        address(engine_io::kLogits, logits_);
        for (int32_t slot : {outSlot.nextTokens, outSlot.nextLogprobs, outSlot.topTokens, outSlot.topLogprobs})
            address(outputs().name(slot).c_str(), outputDevice(slot));
        for (int32_t slot : outSlot.statuses) address(outputs().name(slot).c_str(), outputDevice(slot));
    }
    void enqueue(StepShape const&) override {
        if (!context_->enqueueV3(stream()))
            throw std::runtime_error("TensorRT enqueueV3 failed: " + library().logger.take());
    }

private:
    void bind(char const* name, void* ptr, Dims const& shape) {
        if (!context_->setInputShape(name, shape))
            throw std::runtime_error(std::string("TensorRT setInputShape(") + name + ") failed: " + library().logger.take());
        address(name, ptr);
    }
    void address(char const* name, void* ptr) {
        if (!context_->setTensorAddress(name, ptr))
            throw std::runtime_error(std::string("TensorRT setTensorAddress(") + name + ") failed: " +
                                     library().logger.take());
    }

    Owned<nvinfer1::IRuntime> runtime_;
    Owned<nvinfer1::ICudaEngine> engine_;
    Owned<nvinfer1::IExecutionContext> context_;
    void* logits_ = nullptr;
};

}  // namespace

std::string loadTensorRT() { return library().description; }

void checkPluginLibrary(std::string const& path) {
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) throw PluginLibraryError("plugin library " + path + ": cannot load it: " + dlerror());
    using GetCreators = nvinfer1::IPluginCreatorInterface* const* (*)(int32_t&);
    auto getCreators = reinterpret_cast<GetCreators>(dlsym(h, "getCreators"));
    if (!getCreators) {
        dlclose(h);
        throw PluginLibraryError("plugin library " + path + ": not a TensorRT plugin library (no getCreators)");
    }
    int32_t n = 0;
    nvinfer1::IPluginCreatorInterface* const* list = getCreators(n);
    std::set<std::string> found;
    for (int32_t i = 0; list && i < n; ++i) {
        nvinfer1::InterfaceInfo const info = list[i]->getInterfaceInfo();
        if (!info.kind || std::strcmp(info.kind, "PLUGIN CREATOR_V3ONE") != 0) continue;
        auto* c = static_cast<nvinfer1::IPluginCreatorV3One*>(list[i]);
        if (std::strcmp(c->getPluginNamespace(), plugin::kPluginNamespace) == 0) found.insert(c->getPluginName());
    }
    dlclose(h);
    for (char const* name : {plugin::kQKVWritePluginName, plugin::kAttentionPluginName})
        if (!found.count(name))
            throw PluginLibraryError("plugin library " + path + ": not the pagedkv plugin library (no " + name +
                                     " creator in namespace '" + plugin::kPluginNamespace + "')");
}

std::unique_ptr<DeviceExecutor> openTensorRTEngine(TensorRTOptions const& options) {
    checkPluginLibrary(options.pluginLibrary);
    Opened opened = openEngine(options);
    return std::make_unique<TrtExecutor>(std::move(opened), options);
}

}  // namespace pagedkv::runtime
