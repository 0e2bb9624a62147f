// context.cuh: what every CUDA op launcher needs: the stream, the device's SM count, the cuBLAS
// handle (when built with cuBLAS) and scratch buffers that grow on demand.
#pragma once

#include "common.cuh"

#include <algorithm>

namespace kd::cuda {

// A device buffer that only grows. Growing waits for the device (the old buffer may still be
// read by queued work), so callers size it before a graph capture or a timed loop.
class Scratch {
public:
    Scratch() = default;
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
    ~Scratch() {
        if (ptr_) cudaFree(ptr_);
    }
    // At least nbytes; new memory is zero-filled (split-K counters rely on it).
    void* get(size_t nbytes) {
        if (nbytes > cap_) {
            if (ptr_) {
                KD_CUDA_CHECK(cudaDeviceSynchronize());
                KD_CUDA_CHECK(cudaFree(ptr_));
                ptr_ = nullptr;
            }
            cap_ = std::max<size_t>(nbytes, 2 * cap_);
            KD_CUDA_CHECK(cudaMalloc(&ptr_, cap_));
            KD_CUDA_CHECK(cudaMemset(ptr_, 0, cap_));
        }
        return ptr_;
    }
    template <class T>
    T* get(size_t count) { return static_cast<T*>(get(sizeof(T) * count)); }

private:
    void* ptr_ = nullptr;
    size_t cap_ = 0;
};

struct Context {
    cudaStream_t stream = nullptr;
    int num_sms = 0;
    void* cublas = nullptr;     // cublasHandle_t in builds with cuBLAS, else null
    void* cublas_workspace = nullptr;
    bool use_cublas = false;    // matmul_f32 through cuBLAS (else our kernel)
    Scratch split_ws, split_counters;          // matmul split-K
    Scratch sched;                             // matmul dynamic-scheduling counters
    Scratch moe_lists, moe_h, moe_y;           // moe_ffn routing lists and intermediates
    Scratch cublas_x, cublas_y;                // matmul_f32 padding for cuBLAS
    Scratch host_ints;                         // *_host int arrays copied to the device
    Scratch w4_staging;                        // upload_w4a16: weights before tiling
    Scratch small;                             // argmax / top-k results before download

    // Copies n ints from the host into device scratch (stream ordered) and returns them.
    const int32_t* upload_ints(const int32_t* host, size_t n) {
        int32_t* d = host_ints.get<int32_t>(std::max<size_t>(n, 1));
        if (n) KD_CUDA_CHECK(cudaMemcpyAsync(d, host, sizeof(int32_t) * n, cudaMemcpyHostToDevice, stream));
        return d;
    }
};

}  // namespace kd::cuda
