// Describing a C API's structs field by field, for bindings that build their mirrors from the library
// (src/pagedkv/kernels/_structs.py) instead of copying them by hand. Used by the kernels' C API
// (capi/capi_structs.cpp: pagedkv_struct_layouts) and the runtime's two (runtime/capi/kv_capi.cpp:
// pagedkv_kv_struct_layouts, runtime/capi/runtime_capi.cpp: pagedkv_rt_struct_layouts). Host C++ only.
//
// A description is a constexpr array of PKV_FIELD(Struct, member) entries. An API's *_struct_layouts() entry lists
// each of its structs once, PKV_DESCRIBE(Struct, array), in describeStructs({...}): that checks at compile time
// (listsEveryField) that the entries follow one another as the C++ layout rules place them and end at sizeof, so
// a member added to a struct (or reordered, or retyped) without its entry fails the build instead of shifting a
// binding, and renders the JSON the bindings read:
//   {"Name": {"size": S, "align": A, "fields": [{"name", "type", "offset", "size"[, "count"]}, ...]}, ...}
// with type one of i32, i64, u64, f32, f64, bool, ptr, str (a NUL-terminated char const*), or a described struct's name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <string>
#include <type_traits>

namespace pagedkv {
namespace structdesc {

struct FieldDesc {
    char const* name;
    size_t offset;
    size_t size;   // of the whole member (all elements of an array)
    size_t align;
    char const* type;
    size_t count;  // array elements; 0 for a scalar
};

// Nested described structs specialize this in the file that describes them.
template <typename T>
struct TypeName;
template <> struct TypeName<int32_t> { static constexpr char const* value = "i32"; };
template <> struct TypeName<int64_t> { static constexpr char const* value = "i64"; };
template <> struct TypeName<uint64_t> { static constexpr char const* value = "u64"; };
template <> struct TypeName<float> { static constexpr char const* value = "f32"; };
template <> struct TypeName<double> { static constexpr char const* value = "f64"; };
template <> struct TypeName<bool> { static constexpr char const* value = "bool"; };
static_assert(std::is_same_v<size_t, uint64_t>, "size_t fields are described as u64");

template <typename T>
constexpr char const* typeName() {
    using E = std::remove_all_extents_t<T>;
    if constexpr (std::is_same_v<E, char const*>) {
        return "str";
    } else if constexpr (std::is_pointer_v<E>) {
        return "ptr";
    } else if constexpr (std::is_enum_v<E>) {
        return TypeName<std::underlying_type_t<E>>::value;
    } else {
        return TypeName<E>::value;
    }
}

template <typename S, size_t N>
constexpr bool listsEveryField(FieldDesc const (&fields)[N]) {
    static_assert(std::is_standard_layout_v<S> && std::is_trivially_copyable_v<S>, "C API structs are PODs");
    size_t end = 0;
    for (size_t i = 0; i < N; ++i) {
        size_t const start = (end + fields[i].align - 1) / fields[i].align * fields[i].align;
        if (fields[i].offset != start) return false;
        end = start + fields[i].size;
    }
    return (end + alignof(S) - 1) / alignof(S) * alignof(S) == sizeof(S);
}

// One struct's entry of the JSON, its description `Fields` checked against S (PKV_DESCRIBE names it).
template <typename S, auto const& Fields>
std::string describeStruct(char const* name) {
    static_assert(listsEveryField<S>(Fields), "the description does not list the struct's members in order");
    std::string out = std::string("\"") + name + "\":{\"size\":" + std::to_string(sizeof(S)) +
                      ",\"align\":" + std::to_string(alignof(S)) + ",\"fields\":[";
    for (size_t i = 0; i < std::size(Fields); ++i) {
        FieldDesc const& f = Fields[i];
        out += std::string(i ? "," : "") + "{\"name\":\"" + f.name + "\",\"type\":\"" + f.type +
               "\",\"offset\":" + std::to_string(f.offset) + ",\"size\":" + std::to_string(f.size) +
               (f.count ? ",\"count\":" + std::to_string(f.count) : "") + "}";
    }
    return out + "]}";
}

// The JSON object of an API's structs, from their PKV_DESCRIBE entries.
inline std::string describeStructs(std::initializer_list<std::string> entries) {
    std::string out = "{";
    for (std::string const& e : entries) out += (out.size() > 1 ? "," : "") + e;
    return out + "}";
}

}  // namespace structdesc
}  // namespace pagedkv

#define PKV_FIELD(S, f)                                                                                       \
    ::pagedkv::structdesc::FieldDesc {                                                                        \
        #f, offsetof(S, f), sizeof(S::f), alignof(std::remove_all_extents_t<decltype(S::f)>),                 \
            ::pagedkv::structdesc::typeName<decltype(S::f)>(), std::extent_v<decltype(S::f)>                  \
    }

// The entry of struct S described by the FieldDesc array `fields`, named as S is spelled here.
#define PKV_DESCRIBE(S, fields) ::pagedkv::structdesc::describeStruct<S, fields>(#S)
