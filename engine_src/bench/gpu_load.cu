// gpu_load.cu: a GPU load generator, the co-tenant of the contention tests (scripts/gpu_load.sh,
// run_tests.sh with KD_GPU_LOAD, bench/gpu_validate.sh --contention). It keeps a chosen share of
// the SMs busy in one or several load shapes until it is stopped (SIGTERM or SIGINT) or its time
// is up, then prints one summary line. It needs nothing but the CUDA runtime.
//
//   gpu_load [--shape LIST] [--share F] [--seconds S] [--period-ms P] [--kernel-us U] [--mem-mb M]
//            [--ready FILE] [--seed N]
//
// Shapes (LIST: comma-separated, taken in turn for P ms each; `cycle` is all of them):
//   compute  FMA chains, kernels of U us (default 2000)
//   mma      tensor-core mma.sync chains (fp16 in, fp32 accumulate), kernels of U us, like a
//            framework's matrix-product loop
//   memory   copies between two buffers of M MiB each (default 512), kernels of U us
//   burst    kernels of 20 us, 64 at a time: many launches, many short slices of the GPU
//   pulse    busy kernels of 0.2 to 4 ms with idle gaps of 0 to 2 ms, at random (--seed)
// A block holds a whole SM (its shared memory request leaves room for no second block), and a
// launch has round(F x SMs) blocks (at least one), so F is the share of the SMs a kernel holds
// when it runs. Without MPS, kernels of different processes take turns on the GPU (time
// slices) whatever F is; with MPS they share it and F is what the other process is left.
// Two units of work are kept queued, so the GPU never waits for this program's host thread.
// The ready file is written once the first unit has finished (the load is really running).
// Exit 0 after a clean stop; 1 on a CUDA error; 2 on a bad flag.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

#define LOAD_CHECK(call)                                                                                  \
    do {                                                                                                  \
        const cudaError_t err_ = (call);                                                                  \
        if (err_ != cudaSuccess)                                                                          \
            throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorString(err_));               \
    } while (0)

constexpr int kThreads = 1024;
const char* const kShapes[] = {"compute", "mma", "memory", "burst", "pulse"};

volatile std::sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// Every kernel runs until the device clock passes start + ns (the block's own start), checking
// it every few hundred instructions; `sink` is written only on a value no run produces, so the
// work cannot be optimised away.
__global__ void __launch_bounds__(kThreads) compute_kernel(float* sink, unsigned long long ns) {
    const unsigned long long end = now_ns() + ns;
    float a = threadIdx.x * 1e-3f, b = 1.0001f, c = 0.9999f, d = blockIdx.x * 1e-3f;
    do {
#pragma unroll 16
        for (int i = 0; i < 256; ++i) {
            a = fmaf(a, b, c);
            d = fmaf(d, c, b);
        }
    } while (now_ns() < end);
    if (a + d == -1.0f) sink[threadIdx.x] = a + d;
}

__global__ void __launch_bounds__(kThreads) mma_kernel(float* sink, unsigned long long ns) {
    const unsigned long long end = now_ns() + ns;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if __CUDA_ARCH__ >= 800
    const __half2 h = __floats2half2_rn(1e-3f * (threadIdx.x & 31), 1e-3f);
    const uint32_t a = *reinterpret_cast<const uint32_t*>(&h);
    do {
#pragma unroll 16
        for (int i = 0; i < 64; ++i)
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %4, %4, %4}, {%4, %4}, "
                "{%0, %1, %2, %3};"
                : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                : "r"(a));
    } while (now_ns() < end);
#else
    while (now_ns() < end) acc[0] += 1.0f;
#endif
    if (acc[0] + acc[1] + acc[2] + acc[3] == -1.0f) sink[threadIdx.x] = acc[0];
}

__global__ void __launch_bounds__(kThreads) memory_kernel(float4* dst, const float4* src, size_t n, unsigned long long ns) {
    const unsigned long long end = now_ns() + ns;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    do {
        for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
            float4 v = src[i];
            v.x += 1.0f;
            dst[i] = v;
        }
    } while (now_ns() < end);
}

struct Options {
    std::vector<std::string> shapes{"compute"};
    double share = 1.0, seconds = 0.0;
    int period_ms = 500, kernel_us = 2000, mem_mb = 512;
    unsigned seed = 1;
    std::string ready;
};

[[noreturn]] void usage(const std::string& why) {
    std::fprintf(stderr, "gpu_load: %s\nusage: gpu_load [--shape compute,mma,memory,burst,pulse|cycle] [--share F (0,1]] "
                         "[--seconds S] [--period-ms P] [--kernel-us U] [--mem-mb M] [--ready FILE] [--seed N]\n",
                 why.c_str());
    std::exit(2);
}

double number(const char* flag, const char* text, double lo, double hi) {
    char* end = nullptr;
    const double v = std::strtod(text, &end);
    if (end == text || *end != '\0' || !(v >= lo && v <= hi))
        usage(std::string(flag) + " must be a number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" +
              text + "'");
    return v;
}

std::vector<std::string> parse_shapes(const std::string& list) {
    if (list == "cycle") return std::vector<std::string>(std::begin(kShapes), std::end(kShapes));
    std::vector<std::string> out;
    size_t start = 0;
    while (start <= list.size()) {
        const size_t comma = std::min(list.find(',', start), list.size());
        const std::string s = list.substr(start, comma - start);
        bool known = false;
        for (const char* k : kShapes) known = known || s == k;
        if (!known) usage("unknown shape '" + s + "' in --shape " + list);
        out.push_back(s);
        start = comma + 1;
    }
    return out;
}

Options parse(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (i + 1 >= argc) usage("flag " + a + " needs a value");
        const char* v = argv[++i];
        if (a == "--shape") o.shapes = parse_shapes(v);
        else if (a == "--share") o.share = number("--share", v, 1e-6, 1.0);
        else if (a == "--seconds") o.seconds = number("--seconds", v, 0.0, 1e6);
        else if (a == "--period-ms") o.period_ms = static_cast<int>(number("--period-ms", v, 1, 3.6e6));
        else if (a == "--kernel-us") o.kernel_us = static_cast<int>(number("--kernel-us", v, 10, 1e6));
        else if (a == "--mem-mb") o.mem_mb = static_cast<int>(number("--mem-mb", v, 1, 65536));
        else if (a == "--ready") o.ready = v;
        else if (a == "--seed") o.seed = static_cast<unsigned>(number("--seed", v, 0, 4294967295.0));
        else usage("unknown flag " + a);
    }
    return o;
}

class Load {
public:
    explicit Load(const Options& o) : o_(o) {
        LOAD_CHECK(cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync));  // the host thread sleeps in waits
        int dev = 0;
        LOAD_CHECK(cudaGetDevice(&dev));
        LOAD_CHECK(cudaGetDeviceProperties(&prop_, dev));
        blocks_ = std::max(1, static_cast<int>(o.share * prop_.multiProcessorCount + 0.5));
        // More than half an SM's shared memory: one block per SM.
        smem_ = static_cast<int>(std::min(prop_.sharedMemPerBlockOptin, prop_.sharedMemPerMultiprocessor / 2 + 1024));
        for (const void* k : {reinterpret_cast<const void*>(compute_kernel), reinterpret_cast<const void*>(mma_kernel),
                              reinterpret_cast<const void*>(memory_kernel)}) {
            LOAD_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_));
            int per_sm = 0;
            LOAD_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kThreads, smem_));
            if (per_sm != 1) throw std::runtime_error("a load block does not hold a whole SM (" + std::to_string(per_sm) + " fit)");
        }
        LOAD_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        LOAD_CHECK(cudaMalloc(&sink_, sizeof(float) * kThreads));
        n4_ = static_cast<size_t>(o.mem_mb) * (1u << 20) / sizeof(float4);
        LOAD_CHECK(cudaMalloc(&a_, n4_ * sizeof(float4)));
        LOAD_CHECK(cudaMalloc(&b_, n4_ * sizeof(float4)));
        LOAD_CHECK(cudaMemsetAsync(a_, 0, n4_ * sizeof(float4), stream_));
        for (auto& e : done_) LOAD_CHECK(cudaEventCreateWithFlags(&e, cudaEventBlockingSync | cudaEventDisableTiming));
    }
    ~Load() {
        cudaStreamSynchronize(stream_);
        for (auto& e : done_) cudaEventDestroy(e);
        cudaFree(a_);
        cudaFree(b_);
        cudaFree(sink_);
        cudaStreamDestroy(stream_);
    }

    // Runs until stopped or out of time; returns the summary line.
    std::string run() {
        using clock = std::chrono::steady_clock;
        const auto t0 = clock::now();
        const auto elapsed = [&] { return std::chrono::duration<double>(clock::now() - t0).count(); };
        long unit = 0;
        bool ready = false;
        while (!g_stop && (o_.seconds <= 0 || elapsed() < o_.seconds)) {
            const size_t which = static_cast<size_t>(elapsed() * 1000 / o_.period_ms) % o_.shapes.size();
            const std::string& shape = o_.shapes[which];
            const auto u0 = clock::now();
            issue(shape);
            LOAD_CHECK(cudaEventRecord(done_[unit % 2], stream_));
            if (unit > 0) LOAD_CHECK(cudaEventSynchronize(done_[(unit - 1) % 2]));  // two units queued
            busy_[shape] += std::chrono::duration<double>(clock::now() - u0).count();
            ++unit;
            if (!ready && unit > 1) {
                ready = true;
                if (!o_.ready.empty()) std::ofstream(o_.ready) << "ready\n";
                std::printf("gpu_load: ready: %s\n", describe().c_str());
                std::fflush(stdout);
            }
        }
        LOAD_CHECK(cudaStreamSynchronize(stream_));
        LOAD_CHECK(cudaGetLastError());
        char line[512];
        std::snprintf(line, sizeof line, "gpu_load: done after %.1f s: %s; %ld kernels;", elapsed(), describe().c_str(), kernels_);
        std::string out = line;
        for (const auto& [shape, s] : busy_) {
            std::snprintf(line, sizeof line, " %s %.1f s", shape.c_str(), s);
            out += line;
        }
        return out;
    }

private:
    std::string describe() const {
        std::string s;
        for (const auto& x : o_.shapes) s += (s.empty() ? "" : ",") + x;
        char buf[256];
        std::snprintf(buf, sizeof buf, "shapes %s, share %.2f (%d of %d SMs), %s", s.c_str(), o_.share, blocks_,
                      prop_.multiProcessorCount, prop_.name);
        return buf;
    }

    // One unit of a shape: a long kernel, 64 short ones, or a random busy kernel and idle gap.
    void issue(const std::string& shape) {
        const unsigned long long ns = 1000ull * o_.kernel_us;
        if (shape == "compute") launch(compute_kernel, sink_, ns);
        else if (shape == "mma") launch(mma_kernel, sink_, ns);
        else if (shape == "memory") launch(memory_kernel, b_, a_, n4_, ns);
        else if (shape == "burst") for (int i = 0; i < 64; ++i) launch(compute_kernel, sink_, 20000ull);
        else {  // pulse
            launch(compute_kernel, sink_, 200000ull + next() % 3800000ull);
            std::this_thread::sleep_for(std::chrono::microseconds(next() % 2000));
        }
    }

    template <class... Params, class... Args>
    void launch(void (*kernel)(Params...), Args... args) {
        kernel<<<blocks_, kThreads, smem_, stream_>>>(args...);
        LOAD_CHECK(cudaGetLastError());
        ++kernels_;
    }

    unsigned long long next() {  // SplitMix64
        unsigned long long z = (rng_ += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }

    Options o_;
    cudaDeviceProp prop_{};
    int blocks_ = 1, smem_ = 0;
    cudaStream_t stream_ = nullptr;
    float* sink_ = nullptr;
    float4 *a_ = nullptr, *b_ = nullptr;
    size_t n4_ = 0;
    cudaEvent_t done_[2] = {};
    long kernels_ = 0;
    unsigned long long rng_ = o_.seed;
    std::map<std::string, double> busy_;
};

}  // namespace

int main(int argc, char** argv) {
    const Options o = parse(argc, argv);
    std::signal(SIGTERM, on_signal);
    std::signal(SIGINT, on_signal);
    try {
        Load load(o);
        std::printf("%s\n", load.run().c_str());
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "gpu_load: error: %s\n", e.what());
        return 1;
    }
}
