#!/usr/bin/env bash
# GPU kernel benchmarks (bench/bench_gpu.cu): the read-bandwidth ceiling, w4a16 GEMM at
# M = 1..16 against cuBLAS SGEMM and bf16 on K2 shapes, and a K2-shaped MoE layer INT4 vs FP32.
# Builds bench_gpu with nvcc (needs a GPU and cuBLAS), runs it, writes bench_gpu.json, all three
# in $KD_RESULTS_DIR (default build/: build/bench_gpu, build/bench_gpu.json). Then our matmul_w4a16
# (libkd_w4.so there, bench/w4_shim.cu), PyTorch's tinygemm and cuBLAS bf16 interleaved in one
# process on the same shapes (bench/torch_ref.py) into bench_torch.json there: skipped, said so in
# that file, when the Python has no torch or no GPU; it never fails this script.
#   KD_ARCH     sm_90, sm_120, ... (default: from nvidia-smi)   CUDA_HOME (default /usr/local/cuda)
#   KD_BENCH_GPU_ARGS  extra flags for bench_gpu (--quick: fewer repeats and token counts)
#   KD_BENCH_GPU_BUILD_ONLY=1  build bench_gpu and stop
#   KD_TORCH_PYTHON  the Python for bench/torch_ref.py (default $PYTHON, else python3); KD_BENCH_TORCH=0: skip it
#   KD_BENCH_TORCH_ARGS  extra flags for bench/torch_ref.py (--schunk 512,256: ours with forced super-chunks too)
set -euo pipefail
engine="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$engine"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
NVCC="$CUDA_HOME/bin/nvcc"
[[ -x "$NVCC" ]] || { echo "bench_gpu.sh: $NVCC not found (set CUDA_HOME)" >&2; exit 2; }
[[ -f "$CUDA_HOME/include/cublas_v2.h" ]] || { echo "bench_gpu.sh: cuBLAS headers missing under $CUDA_HOME" >&2; exit 2; }
arch="${KD_ARCH:-}"
if [[ -z "$arch" ]]; then
    cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' ')"
    [[ "$cap" =~ ^[0-9]+\.[0-9]+$ ]] || { echo "bench_gpu.sh: no GPU visible; set KD_ARCH" >&2; exit 2; }
    arch="sm_${cap/./}"
fi
cc="${arch#sm_}"
flags=(-O3 -std=c++17 -gencode "arch=compute_${cc},code=sm_${cc}" -Isrc)
results="${KD_RESULTS_DIR:-build}"   # one folder per GPU when several runs share the tree
out="$results/obj/bench_gpu"
mkdir -p "$out"
sources=(bench/bench_gpu.cu src/cuda/matmul_w4a16.cu src/cuda/matmul_f32.cu src/cuda/moe_ffn.cu src/cuda/moe_gate.cu
         src/cuda/elementwise.cu)
objects=()
pids=()
for src in "${sources[@]}"; do
    o="$out/$(basename "${src%.cu}").o"
    objects+=("$o")
    "$NVCC" "${flags[@]}" -c "$src" -o "$o" &
    pids+=($!)
done
# The shim torch_ref.py loads: matmul_w4a16 with position-independent host code. No unique
# symbols (-fno-gnu-unique): the function-local statics of templates (w4_launch_q's "shared memory
# limit raised" flag) would otherwise be one object for every such library in the process, and
# another tree's shim loaded beside it (torch_ref.py --kept) would skip raising its own kernel's.
"$NVCC" "${flags[@]}" -Xcompiler -fPIC,-fno-gnu-unique -shared bench/w4_shim.cu src/cuda/matmul_w4a16.cu \
    -o "$results/libkd_w4.so" &
pids+=($!)
for p in "${pids[@]}"; do wait "$p" || { echo "bench_gpu.sh: compile failed" >&2; exit 1; }; done
"$NVCC" "${flags[@]}" "${objects[@]}" -o "$results/bench_gpu" -lcublas
[[ "${KD_BENCH_GPU_BUILD_ONLY:-0}" == 1 ]] && exit 0
# shellcheck disable=SC2086  # a list of flags
"$results/bench_gpu" --json "$results/bench_gpu.json" ${KD_BENCH_GPU_ARGS:-}
rm -f "$results/bench_torch.json"
if [[ "${KD_BENCH_TORCH:-1}" != 0 ]]; then
    quick=()
    [[ " ${KD_BENCH_GPU_ARGS:-} " == *" --quick "* ]] && quick=(--quick)
    # shellcheck disable=SC2086  # a list of flags
    timeout -k 5 "${KD_BENCH_TORCH_TIMEOUT:-180}" "${KD_TORCH_PYTHON:-${PYTHON:-python3}}" bench/torch_ref.py \
        --json "$results/bench_torch.json" --ours "$results/libkd_w4.so" ${quick[@]+"${quick[@]}"} \
        ${KD_BENCH_TORCH_ARGS:-} ||
        echo "bench_gpu.sh: bench/torch_ref.py exited $? (its figures are missing from this run)" >&2
fi
