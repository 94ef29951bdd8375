"""Python bindings of the CUDA kernels through the C API (device pointers from pagedkv.cuda)."""
