// context.cuh: what every CUDA op launcher needs: the stream, the device's SM count, the cuBLAS
// handle (when built with cuBLAS) and scratch buffers that grow on demand.
#pragma once

#include "common.cuh"

#include <algorithm>
#include <vector>

namespace kd::cuda {

// A device buffer that only grows, zero-filled in the order of the stream it is bound to.
// Growing waits for the device (the old buffer may still be read by queued work), so callers
// size it before a graph capture or a timed loop.
//
// The zero fill must be stream-ordered: the counters of the matmul kernels (split-K, dynamic
// scheduling) rely on it, and the stream is non-blocking, so a plain cudaMemset (the legacy
// default stream) would race the kernels and copies queued after it. That race was issue 16:
// alone on the GPU the memset happened to finish first; with another process on the GPU it
// could land after an upload into the new buffer (zeroed weights, positions, parents) or after a
// kernel had read stale counters (tiles skipped, tile indices out of range).
class Scratch {
public:
    explicit Scratch(const cudaStream_t& stream) : stream_(stream) {}
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
    ~Scratch() {
        if (ptr_) cudaFree(ptr_);
    }
    // At least nbytes; new memory reads as zeros to everything queued on the stream after this call.
    void* get(size_t nbytes) {
        if (nbytes > cap_) {
            // Graph captures run only after an eager run of the same unit has sized every buffer.
            if (counters().capturing)
                throw std::runtime_error("cuda: a scratch buffer had to grow to " + std::to_string(nbytes) +
                                         " bytes during a CUDA graph capture");
            if (ptr_) {
                count_sync();
                KD_CUDA_CHECK(cudaDeviceSynchronize());
                KD_CUDA_CHECK(cudaFree(ptr_));
                ptr_ = nullptr;
            }
            cap_ = std::max<size_t>(nbytes, 2 * cap_);
            counters().scratch_moves++;
            KD_CUDA_CHECK(cudaMalloc(&ptr_, cap_));
            KD_CUDA_CHECK(cudaMemsetAsync(ptr_, 0, cap_, stream_));
        }
        return ptr_;
    }
    template <class T>
    T* get(size_t count) { return static_cast<T*>(get(sizeof(T) * count)); }

private:
    const cudaStream_t& stream_;  // the owner's stream (set before the first get)
    void* ptr_ = nullptr;
    size_t cap_ = 0;
};

struct Context {
    cudaStream_t stream = nullptr;
    int num_sms = 0;
    void* cublas = nullptr;     // cublasHandle_t in builds with cuBLAS, else null
    void* cublas_workspace = nullptr;
    bool use_cublas = false;    // matmul_f32 through cuBLAS (else our kernel)
    // Every buffer below is bound to `stream` (declared above them, so it exists first).
    Scratch split_ws{stream}, split_counters{stream};          // matmul split-K
    Scratch sched{stream};                                     // matmul dynamic-scheduling counters
    Scratch moe_lists{stream}, moe_h{stream}, moe_y{stream};   // moe_ffn routing lists and intermediates
    Scratch cublas_x{stream}, cublas_y{stream};                // matmul_f32 padding for cuBLAS
    Scratch host_ints{stream};                                 // *_host int arrays copied to the device
    Scratch host_committed{stream};                            // Visibility::committed beside them
    Scratch host_parents{stream};                              // tree_accept's parents beside its tokens
    Scratch w4_staging{stream};                                // upload_w4a16: weights before tiling
    Scratch small{stream};                                     // argmax results before download
    Scratch accept_count{stream};                              // tree_accept: rows done (zero between launches)
    Scratch staged_dev{stream};                                // a unit's host inputs (backend.h begin_unit)

    // The host inputs of the open unit: where each array was sent in staged_dev, and the
    // values sent (in pinned memory), so an op that gets the same array reads that copy.
    struct StagedInts {
        const int32_t* host;
        size_t n;
        const int32_t* pinned;
        const int32_t* dev;
    };
    std::vector<StagedInts> staged;

    // n ints from the host in device memory (stream ordered): the open unit's copy when `host`
    // is one of its staged arrays with the values it was staged with, else a copy made now into
    // `into` (an op that uploads two arrays gives each its own buffer).
    const int32_t* upload_ints(const int32_t* host, size_t n, Scratch* into = nullptr) {
        for (const StagedInts& a : staged)
            if (a.host == host && n <= a.n && std::equal(host, host + n, a.pinned)) return a.dev;
        if (n && counters().capturing)  // a graph must not copy from pageable memory at replay
            throw std::runtime_error("cuda: a host input that was not staged reached an op during a CUDA graph capture");
        int32_t* d = (into ? *into : host_ints).get<int32_t>(std::max<size_t>(n, 1));
        if (n) {
            count_copy(cudaMemcpyHostToDevice);
            KD_CUDA_CHECK(cudaMemcpyAsync(d, host, sizeof(int32_t) * n, cudaMemcpyHostToDevice, stream));
        }
        return d;
    }
};

}  // namespace kd::cuda
