// driver_api.h — what the fake CUDA libraries built on the emulator share (see driver.cpp).
//
// The fake libcuda.so.1 runs every stream operation at once, on the calling thread, in call
// order ("device" memory is host memory), except while a stream captures a graph: then the
// operation is recorded and runs at each launch of the instantiated graph. The fake
// libcublas.so.13 / libcublasLt.so.13 (cublas.cpp) link against it and put their GEMMs on a
// stream through `cuemu::enqueue`, so they are captured like kernels.
#pragma once

#include <functional>

namespace cuemu {
// Runs `op` in `stream`'s order (a CUstream; null is the legacy default stream).
void enqueue(void* stream, std::function<void()> op);
}  // namespace cuemu
