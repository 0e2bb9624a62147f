// common.cuh: error checking and small device helpers shared by the CUDA op files.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>

namespace kd::cuda {

// Every CUDA runtime call goes through KD_CUDA_CHECK; every launch is followed by
// KD_CUDA_LAUNCH_CHECK(op) so a bad launch is reported with the op that made it.
inline void check(cudaError_t err, const char* what, const char* file, int line) {
    if (err != cudaSuccess)
        throw std::runtime_error(std::string("cuda: ") + what + " failed at " + file + ":" + std::to_string(line) +
                                 ": " + cudaGetErrorString(err));
}
#define KD_CUDA_CHECK(call) ::kd::cuda::check((call), #call, __FILE__, __LINE__)
#define KD_CUDA_LAUNCH_CHECK(op) \
    (::kd::cuda::count_launch(), ::kd::cuda::check(cudaGetLastError(), op " launch", __FILE__, __LINE__))

// What the process queued on its GPUs, counted where the calls are made (every launcher calls
// count_launch through KD_CUDA_LAUNCH_CHECK or launch_chained): kernels launched on their own
// (`launches`) or recorded into a CUDA graph while a stream was being captured (`captured`),
// graph replays, copies by direction and host waits (stream, event or device synchronisation).
// Process-wide: one engine process drives one backend.
struct LaunchCounters {
    std::atomic<long> launches{0}, captured{0}, graph_launches{0}, h2d{0}, d2h{0}, d2d{0}, syncs{0};
    std::atomic<bool> capturing{false};  // set by the backend around a stream capture
    // Kernels run inside replayed graphs; scratch buffers moved (a graph that holds their old
    // addresses must be captured again).
    std::atomic<long> replayed{0}, scratch_moves{0};
};
inline LaunchCounters& counters() {
    static LaunchCounters c;
    return c;
}
inline void count_launch() {
    LaunchCounters& c = counters();
    (c.capturing ? c.captured : c.launches)++;
}
// A copy of `kind` queued outside a capture (a captured one is a graph node, counted with it).
inline void count_copy(cudaMemcpyKind kind) {
    LaunchCounters& c = counters();
    if (c.capturing) return;
    (kind == cudaMemcpyHostToDevice ? c.h2d : kind == cudaMemcpyDeviceToHost ? c.d2h : c.d2d)++;
}
inline void count_sync() { counters().syncs++; }

inline int ceil_div(long a, long b) { return static_cast<int>((a + b - 1) / b); }

// Programmatic dependent launch (sm_90 and later) for the chains of small kernels of the matmul
// and MoE ops: launched with launch_chained, a kernel's blocks are scheduled while the kernel
// before it in the stream drains (that one calls chain_release as it starts); chain_acquire, the
// first thing such a kernel does, waits until the kernel before it has finished and its writes
// are visible. So only launch latency and block scheduling overlap, never reads or writes.
// Elsewhere both are no-ops and launch_chained is a plain launch.
__device__ __forceinline__ void chain_acquire() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void chain_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Whether the current device is sm_90 or later (queried once).
inline bool device_is_sm90_or_later() {
    static const bool yes = [] {
        int device = 0, major = 0;
        check(cudaGetDevice(&device), "cudaGetDevice", __FILE__, __LINE__);
        check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute",
              __FILE__, __LINE__);
        return major >= 9;
    }();
    return yes;
}

// The current device's opt-in limit of dynamic shared memory per block, in bytes (queried once):
// 227 KiB on sm_90, 99 KiB on sm_120, so a kernel sized for Hopper must check it.
inline int device_smem_optin() {
    static const int bytes = [] {
        int device = 0, optin = 0;
        check(cudaGetDevice(&device), "cudaGetDevice", __FILE__, __LINE__);
        check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute",
              __FILE__, __LINE__);
        return optin;
    }();
    return bytes;
}

// Whether the small kernels of the other ops (rmsnorm, rope, add, attention, ...) are chained
// too (launch_op): on unless KD_CUDA_CHAIN_ALL=0 (then only the matmul and MoE kernels are, as
// before issue 21's fifth pass; kept to measure what chaining the rest is worth).
inline bool chain_all_ops() {
    static const bool on = [] {
        const char* v = std::getenv("KD_CUDA_CHAIN_ALL");
        return !(v && v[0] == '0');
    }();
    return on;
}

// kernel<<<grid, block, smem, stream>>>(args...), allowed to start while the previous kernel in
// the stream finishes (see chain_acquire); `what` names the kernel in a launch error. `chain`
// false: a plain launch (the kernel's chain_acquire / chain_release are then no-ops).
template <class... Params, class... Args>
void launch_chained_if(bool chain, const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                       cudaStream_t stream, Args&&... args) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = chain && device_is_sm90_or_later() ? 1 : 0;
    count_launch();
    check(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), what, __FILE__, __LINE__);
}

// The matmul and MoE kernels: always chained.
template <class... Params, class... Args>
void launch_chained(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                    cudaStream_t stream, Args&&... args) {
    launch_chained_if(true, what, kernel, grid, block, smem, stream, std::forward<Args>(args)...);
}

// Every other op's kernel (issue 21, fifth pass): chained unless KD_CUDA_CHAIN_ALL=0. Such a kernel
// calls chain_acquire before it reads or writes anything and chain_release right after, as the
// matmul kernels do, so a round's GPU time loses a launch latency per kernel boundary while what
// runs in which order stays the same.
template <class... Params, class... Args>
void launch_op(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
               Args&&... args) {
    launch_chained_if(chain_all_ops(), what, kernel, grid, block, smem, stream, std::forward<Args>(args)...);
}

// Dynamic tile scheduling: ctr[0] hands out work, ctr[1] counts blocks done. Called by every
// thread of a block when it has taken its last unit: after a block barrier, the grid's last block
// resets both counters to zero for the next launch.
__device__ __forceinline__ void sched_block_done(unsigned* ctr) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(ctr + 1, 1u) == gridDim.x - 1) {
            ctr[0] = 0;
            ctr[1] = 0;
        }
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// (value, index) arg-max across a warp; ties go to the lower index. Every lane gets the result.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
}

// Block-wide arg-max (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ void block_argmax(float& v, int& i) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    warp_argmax(v, i);
    __syncthreads();  // the arrays may still be read by a previous call
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    v = lane < nw ? sv[lane] : -INFINITY;
    i = lane < nw ? si[lane] : 0x7fffffff;
    warp_argmax(v, i);
}

// Block-wide sum in a fixed tree (lanes, then warps): deterministic for a given blockDim.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float s[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) s[warp] = v;
    __syncthreads();
    v = lane < nw ? s[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v) {
    __shared__ float s[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) s[warp] = v;
    __syncthreads();
    v = lane < nw ? s[lane] : -INFINITY;
    return warp_max(v);
}

// silu(a) * b exactly as backend.h states it (a / (1 + exp(-a)), full-precision expf).
__device__ __forceinline__ float silu_mul_f(float a, float b) { return a / (1.0f + expf(-a)) * b; }

}  // namespace kd::cuda
