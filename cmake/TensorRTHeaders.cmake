# Finds TensorRT's public headers without linking libnvinfer.
# Order: -DTENSORRT_ROOT / $TENSORRT_ROOT, system include paths, an installed TensorRT; otherwise the pinned
# PyPI wheel kernel-lens==2.0.1 (TensorRT 10.14 public headers, Apache-2.0) is fetched with pip into the
# build tree, its sha256 checked, and its kernel_lens/include/tensorrt/ used. Nothing is committed.
# Sets TENSORRT_INCLUDE_DIR and PAGEDKV_TRT_HEADERS_SOURCE (recorded in the build for `pagedkv doctor`).

set(_pkv_kl_version "2.0.1")
set(_pkv_kl_sha256 "07cc714e8b5e7f34b672f7c7fad93febe7c747be5837ba276b1527370134ffe0")

if(NOT DEFINED TENSORRT_ROOT AND DEFINED ENV{TENSORRT_ROOT})
  set(TENSORRT_ROOT "$ENV{TENSORRT_ROOT}")
endif()

set(_pkv_hints "")
if(TENSORRT_ROOT)
  list(APPEND _pkv_hints "${TENSORRT_ROOT}/include")
endif()
find_path(TENSORRT_INCLUDE_DIR NvInferRuntime.h
  HINTS ${_pkv_hints}
  PATHS /usr/include/x86_64-linux-gnu /usr/include/aarch64-linux-gnu /usr/include /usr/local/include
        /usr/local/tensorrt/include /opt/tensorrt/include
  NO_CACHE)

if(TENSORRT_INCLUDE_DIR)
  if(TENSORRT_ROOT AND TENSORRT_INCLUDE_DIR STREQUAL "${TENSORRT_ROOT}/include")
    set(PAGEDKV_TRT_HEADERS_SOURCE "TENSORRT_ROOT=${TENSORRT_ROOT}")
  else()
    set(PAGEDKV_TRT_HEADERS_SOURCE "system:${TENSORRT_INCLUDE_DIR}")
  endif()
else()
  set(_pkv_dir "${CMAKE_BINARY_DIR}/_deps/kernel-lens")
  set(_pkv_wheel "${_pkv_dir}/kernel_lens-${_pkv_kl_version}-py3-none-any.whl")
  if(DEFINED ENV{PAGEDKV_KERNEL_LENS_WHEEL} AND NOT EXISTS "${_pkv_wheel}")
    # Offline builds: point at a downloaded copy of the same wheel (the hash is still checked).
    file(MAKE_DIRECTORY "${_pkv_dir}")
    file(COPY_FILE "$ENV{PAGEDKV_KERNEL_LENS_WHEEL}" "${_pkv_wheel}")
  endif()
  if(NOT EXISTS "${_pkv_wheel}")
    find_package(Python COMPONENTS Interpreter REQUIRED)
    message(STATUS "pagedkv: no TensorRT headers found; fetching kernel-lens==${_pkv_kl_version} with pip")
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -m pip download --no-deps --only-binary=:all: --disable-pip-version-check
              -d "${_pkv_dir}" "kernel-lens==${_pkv_kl_version}"
      RESULT_VARIABLE _pkv_rc OUTPUT_VARIABLE _pkv_out ERROR_VARIABLE _pkv_err)
    if(NOT _pkv_rc EQUAL 0 OR NOT EXISTS "${_pkv_wheel}")
      message(FATAL_ERROR "pagedkv: TensorRT headers not found (set TENSORRT_ROOT) and fetching "
                          "kernel-lens==${_pkv_kl_version} with pip failed:\n${_pkv_out}\n${_pkv_err}")
    endif()
  endif()
  file(SHA256 "${_pkv_wheel}" _pkv_got)
  if(NOT _pkv_got STREQUAL _pkv_kl_sha256)
    file(REMOVE "${_pkv_wheel}")
    message(FATAL_ERROR "pagedkv: kernel-lens wheel sha256 mismatch: expected ${_pkv_kl_sha256}, got ${_pkv_got}")
  endif()
  if(NOT EXISTS "${_pkv_dir}/kernel_lens/include/tensorrt/NvInferRuntime.h")
    file(ARCHIVE_EXTRACT INPUT "${_pkv_wheel}" DESTINATION "${_pkv_dir}" PATTERNS "kernel_lens/include/tensorrt/*")
  endif()
  set(TENSORRT_INCLUDE_DIR "${_pkv_dir}/kernel_lens/include/tensorrt")
  set(PAGEDKV_TRT_HEADERS_SOURCE "pypi:kernel-lens==${_pkv_kl_version} (sha256 ${_pkv_kl_sha256})")
endif()

file(STRINGS "${TENSORRT_INCLUDE_DIR}/NvInferVersion.h" _pkv_ver_lines REGEX "#define TRT_(MAJOR|MINOR|PATCH)_ENTERPRISE ")
foreach(_l IN LISTS _pkv_ver_lines)
  if(_l MATCHES "TRT_MAJOR_ENTERPRISE ([0-9]+)")
    set(_pkv_major ${CMAKE_MATCH_1})
  elseif(_l MATCHES "TRT_MINOR_ENTERPRISE ([0-9]+)")
    set(_pkv_minor ${CMAKE_MATCH_1})
  elseif(_l MATCHES "TRT_PATCH_ENTERPRISE ([0-9]+)")
    set(_pkv_patch ${CMAKE_MATCH_1})
  endif()
endforeach()
set(PAGEDKV_TRT_HEADERS_VERSION "${_pkv_major}.${_pkv_minor}.${_pkv_patch}")
message(STATUS "pagedkv: TensorRT ${PAGEDKV_TRT_HEADERS_VERSION} headers from ${PAGEDKV_TRT_HEADERS_SOURCE}: ${TENSORRT_INCLUDE_DIR}")
