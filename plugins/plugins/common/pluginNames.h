// Identity of the plugins (src/pagedkv/config.py: PLUGIN_NAMESPACE, *_PLUGIN_NAME, PLUGIN_VERSION).
// The names are never ONNX or TensorRT op names: the ONNX parser's built-in importers would win.
#pragma once

namespace pagedkv {
namespace plugin {

constexpr char const* kPluginNamespace = "pagedkv";
constexpr char const* kPluginVersion = "1";
constexpr char const* kQKVWritePluginName = "PagedKVQKVWrite";
constexpr char const* kAttentionPluginName = "PagedKVAttention";

}  // namespace plugin
}  // namespace pagedkv
