#!/usr/bin/env bash
# Builds build/kdtree, build/test_ops and build/fuzz incrementally (per-object dependency files),
# with g++, plus nvcc for src/cuda/*.cu when the CUDA backend is chosen, and then also build/gpu_load
# (the GPU load generator of the contention tests, bench/gpu_load.cu). Writes build/build_info.json.
#   KD_BACKEND  auto (default: cuda when $CUDA_HOME/bin/nvcc exists and nvidia-smi sees a GPU) | cpu | cuda
#   KD_ARCH     sm_90, sm_120, ... (default: from nvidia-smi's compute_cap)
#   CUDA_HOME   default /usr/local/cuda;  CXX  default g++
#   KD_SANITIZE 1: AddressSanitizer + UndefinedBehaviorSanitizer (with float-cast-overflow, no
#               recovery) and libstdc++ assertions, -O1 -g (CUDA: host code only)
#   KD_REBUILD  1: discard this backend's objects and binaries first (a full rebuild)
#   KD_BUILD_CACHE  how many earlier trees' binaries build/trees/ keeps (default 4; 0: none)
#   KD_ALLOW_SPILLS 1: link even when a kernel spills registers (CUDA builds record ptxas resource
#               usage per device function in build/cuda_resources.json and fail on a spill)
# Reports its progress as it compiles and links (`::kdtree-progress done=3 total=20 unit=files
# what=compiled src/model.cpp`; the shape: python/kdtree_ref/progress.py).
# `build.sh --key` prints the build key (JSON) and builds nothing.
set -euo pipefail
engine="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$engine"

CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
CXX="${CXX:-g++}"
NVCC="$CUDA_HOME/bin/nvcc"
backend="${KD_BACKEND:-auto}"
arch="${KD_ARCH:-}"
sanitize="${KD_SANITIZE:-0}"

gpu_visible() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }
detected_arch() {  # "9.0" -> sm_90, "12.0" -> sm_120
    local cap
    cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' ')"
    [[ "$cap" =~ ^[0-9]+\.[0-9]+$ ]] && echo "sm_${cap/./}"
}
json_str() { local s="${1//\\/\\\\}"; s="${s//\"/\\\"}"; printf '"%s"' "$s"; }

case "$backend" in
    auto) if [[ -x "$NVCC" ]] && gpu_visible; then backend=cuda; else backend=cpu; fi ;;
    cpu|cuda) ;;
    *) echo "build.sh: KD_BACKEND must be auto, cpu or cuda, got '$backend'" >&2; exit 2 ;;
esac
[[ "$sanitize" == 0 || "$sanitize" == 1 ]] || { echo "build.sh: KD_SANITIZE must be 0 or 1, got '$sanitize'" >&2; exit 2; }
if [[ "$backend" == cuda ]]; then
    [[ -x "$NVCC" ]] || { echo "build.sh: KD_BACKEND=cuda but $NVCC does not exist (set CUDA_HOME)" >&2; exit 2; }
    if [[ -z "$arch" ]]; then
        arch="$(detected_arch || true)"
        [[ -n "$arch" ]] || { echo "build.sh: no GPU visible to nvidia-smi; set KD_ARCH (e.g. sm_90, sm_120)" >&2; exit 2; }
    fi
    [[ "$arch" =~ ^sm_[0-9]+[a-z]?$ ]] || { echo "build.sh: KD_ARCH must look like sm_90 or sm_120, got '$arch'" >&2; exit 2; }
else
    arch=none
fi

# -O3: GCC vectorises the CPU kernels' element-wise loops (attention's q^ and value sums, the
# matmul rows), which -O2's cheap cost model leaves scalar; it never reorders a float sum without
# -ffast-math, so every result is bit-identical. Functions and loops aligned: without it, the
# kernels' speed depended on where the linker placed their hot loops, which moves whenever any
# other file grows (docs/engine/scripts.md, "Build flags").
cxxflags="-O3 -falign-functions=64 -falign-loops=32 -std=c++17 -Wall -Wextra"
san_flags=(-fsanitize=address -fsanitize=undefined -fsanitize=float-cast-overflow -fno-sanitize-recover=all
           -fno-omit-frame-pointer -D_GLIBCXX_ASSERTIONS -g)
[[ "$sanitize" == 1 ]] && cxxflags="-O1 -std=c++17 -Wall -Wextra ${san_flags[*]}"
nvccflags=""
# No build id: it hashes the whole binary, tree stamp included, so two builds that differ only in
# the stamp (a comment edit) would differ in it too; without it they differ in the stamp alone.
ldflags="-Wl,--build-id=none"
libs=""
cublas=false
if [[ "$backend" == cuda ]]; then
    cxxflags="$cxxflags -DKD_WITH_CUDA"
    cc="${arch#sm_}"
    nvccflags="-O2 -std=c++17 -DKD_WITH_CUDA -gencode arch=compute_${cc},code=sm_${cc}"
    # Sanitized CUDA builds instrument the host code (kernels are not instrumented).
    if [[ "$sanitize" == 1 ]]; then for f in "${san_flags[@]}"; do nvccflags+=" -Xcompiler=$f"; done; fi
    # rpath: the binary finds cuBLAS under CUDA_HOME without LD_LIBRARY_PATH (steps run with a clean env).
    if [[ -f "$CUDA_HOME/include/cublas_v2.h" ]]; then cublas=true; libs="-lcublas -Xlinker -rpath -Xlinker $CUDA_HOME/lib64"; fi
    ldflags="-Xlinker --build-id=none"
fi
cxx_version="$("$CXX" --version | head -n1)"
nvcc_version="none"
[[ "$backend" == cuda ]] && nvcc_version="$("$NVCC" --version | grep -i release | head -n1)"

key="{\"backend\": \"$backend\", \"arch\": \"$arch\", \"sanitize\": $([[ "$sanitize" == 1 ]] && echo true || echo false), \"cxx\": $(json_str "$cxx_version"), \"nvcc\": $(json_str "$nvcc_version"), \"cxxflags\": $(json_str "$cxxflags"), \"nvccflags\": $(json_str "$nvccflags"), \"ldflags\": $(json_str "$ldflags"), \"libs\": $(json_str "$libs"), \"cublas\": $cublas}"
if [[ "${1:-}" == "--key" ]]; then echo "$key"; exit 0; fi
[[ $# -eq 0 ]] || { echo "usage: build.sh [--key]" >&2; exit 2; }

started_ns=$(date +%s%N)
obj="build/obj/$backend$([[ "$sanitize" == 1 ]] && echo -san || true)"
mkdir -p "$obj" build/gen
# A changed key (compiler, flags, arch) invalidates every object of this backend; so does KD_REBUILD=1.
if [[ "${KD_REBUILD:-0}" == 1 ]]; then
    echo "build.sh: KD_REBUILD=1: full rebuild"
    rm -f "$obj"/*.o "$obj"/*.d "$obj"/*.res "$obj/key" build/kdtree build/kdtree.key build/test_ops build/test_ops.key build/fuzz build/fuzz.key
fi
if [[ "$(cat "$obj/key" 2>/dev/null || true)" != "$key" ]]; then rm -f "$obj"/*.o "$obj"/*.d "$obj"/*.res; echo "$key" > "$obj/key"; fi

# The source tree hash goes into the binary; the stamp header changes only when it does.
tree="$(bash scripts/tree_hash.sh "$engine")"
stamp="#define KD_TREE_HASH \"$tree\"
#define KD_ARCH \"$arch\""
[[ "$(cat build/gen/build_stamp.h 2>/dev/null || true)" == "$stamp" ]] || echo "$stamp" > build/gen/build_stamp.h

# The binaries of the last KD_BUILD_CACHE trees built are kept in build/trees/<tree>-<key hash>/:
# coming back to one of those trees (a bisect, a revert) restores them instead of compiling.
# A restored binary carries no link key, so the next compiled build always relinks; KD_REBUILD=1
# never restores.
cache_keep="${KD_BUILD_CACHE:-4}"
[[ "$cache_keep" =~ ^[0-9]+$ ]] || { echo "build.sh: KD_BUILD_CACHE must be a number, got '$cache_keep'" >&2; exit 2; }
cached="build/trees/$tree-$(printf '%s' "$key" | sha256sum | cut -c1-16)"
evict() {  # keep the newest cache_keep trees (names are <hex>-<hex>: ls -t is safe)
    # shellcheck disable=SC2012
    ls -1dt build/trees/*/ 2>/dev/null | tail -n +$((cache_keep + 1)) | xargs -r rm -rf --
}
current_tree="$(sed -n 's/.*"tree": "\([0-9a-f]*\)".*/\1/p' build/build_info.json 2>/dev/null | head -n1 || true)"
binaries=(kdtree test_ops fuzz)    # what a build links: all of them are kept and restored
[[ "$backend" == cuda ]] && binaries+=(gpu_load)
have_all() { local b; for b in "${binaries[@]}"; do [[ -f "$1/$b" ]] || return 1; done; }
if [[ "$current_tree" != "$tree" || "$(cat build/kdtree.key 2>/dev/null || true)" != "$key" ]] &&
   (( cache_keep > 0 )) && [[ "${KD_REBUILD:-0}" != 1 && -d "$cached" ]] && have_all "$cached"; then
    for b in "${binaries[@]}"; do
        rm -f "build/$b.key"
        cp -p "$cached/$b" "build/$b.restoring" && mv -f "build/$b.restoring" "build/$b"
    done
    rm -f build/cuda_resources.json
    [[ -f "$cached/cuda_resources.json" ]] && cp -p "$cached/cuda_resources.json" build/
    touch "$cached"
    evict
    cat > build/build_info.json <<JSON
{"version": 1, "tree": "$tree", "binary": "build/kdtree", "test_program": "build/test_ops",
 "key": $key,
 "rebuilt": [], "restored": "$cached", "seconds": 0}
JSON
    echo "build.sh: $(build/kdtree --version) (restored from $cached, nothing compiled)"
    exit 0
fi

# An object is stale when it is missing or older than any file its dependency file names.
stale() {
    local o="$1" d="${1%.o}.d" f
    [[ -f "$o" && -f "$d" ]] || return 0
    for f in $(sed -e 's/\\$//' -e 's/^[^:]*:[[:space:]]*//' "$d"); do
        [[ "$f" == *: ]] && continue
        [[ -e "$f" && ! "$f" -nt "$o" ]] || return 0
    done
    return 1
}

# KD_JOBS: the CPUs the build was given (a Slurm job's, the orchestrator says); else every CPU nproc sees
if [[ "${KD_JOBS:-}" =~ ^[1-9][0-9]{0,3}$ ]]; then jobs_max="$KD_JOBS"; else jobs_max="$(nproc 2>/dev/null || echo 2)"; fi
pids=(); names=(); rebuilt=()
n_compile=0   # how many sources this build compiles (the total of its progress reports)
progress() {  # progress WHAT: a progress report (its shape: python/kdtree_ref/progress.py): compiles ended of all
    echo "::kdtree-progress done=$(( ${#pids[@]} - $(jobs -rp | wc -l) )) total=$n_compile unit=files what=$1"
}
compile() {  # compile OUT SRC: in the background, at most jobs_max at a time
    while (( $(jobs -rp | wc -l) >= jobs_max )); do wait -n || true; done
    local out="$1" src="$2"
    echo "build.sh: compiling $src"
    progress "compiling $src"
    if [[ "$src" == *.cu ]]; then
        # ptxas's resource usage (registers, spills, smem per function) goes to OUT.res, the
        # compiler's other messages to stderr as usual.
        (
            res="${out%.o}.res" rc=0
            echo "source $src" >"$res"
            "$NVCC" $nvccflags --resource-usage -Isrc -Ibuild/gen -MMD -MF "${out%.o}.d" -c "$src" -o "$out" 2>>"$res" || rc=$?
            tail -n +2 "$res" | grep -vE '^(ptxas info|    [0-9]+ bytes stack frame)' >&2 || true
            exit "$rc"
        ) &
    else
        "$CXX" $cxxflags -Isrc -Ibuild/gen -MMD -MP -c "$src" -o "$out" &
    fi
    pids+=($!); names+=("$src"); rebuilt+=("$src")
}

sources=(src/*.cpp tests/test_ops.cpp tests/fuzz.cpp)
[[ "$backend" == cuda ]] && sources+=(src/cuda/*.cu bench/gpu_load.cu)
objects=(); stale_objects=(); stale_sources=()
for src in "${sources[@]}"; do
    [[ -e "$src" ]] || continue
    base="${src//\//_}"; o="$obj/${base%.*}.o"
    objects+=("$o")
    if stale "$o" || [[ "$src" == *.cu && ! -f "${o%.o}.res" ]]; then stale_objects+=("$o"); stale_sources+=("$src"); fi
done
n_compile=${#stale_sources[@]}
for i in "${!stale_sources[@]}"; do compile "${stale_objects[$i]}" "${stale_sources[$i]}"; done
failed=()
for i in "${!pids[@]}"; do
    if kill -0 "${pids[$i]}" 2>/dev/null; then progress "compiling ${names[$i]}"; fi    # what it now waits for
    wait "${pids[$i]}" || failed+=("${names[$i]}")
done
if (( ${#pids[@]} )); then progress "compiled"; fi
if (( ${#failed[@]} )); then
    for f in "${failed[@]}"; do rm -f "$obj/$(echo "${f//\//_}" | sed 's/\.[^.]*$//').o"; done
    echo "build.sh: compile failed: ${failed[*]}" >&2
    exit 1
fi

rm -f build/cuda_resources.json   # rewritten below for a CUDA build; a CPU build has no kernels
if [[ "$backend" == cuda ]]; then
    res_logs=()
    for o in "${objects[@]}"; do [[ -f "${o%.o}.res" ]] && res_logs+=("${o%.o}.res"); done
    rc=0
    bash scripts/cuda_resources.sh "$arch" build/cuda_resources.json "${res_logs[@]}" || rc=$?
    if (( rc == 1 )) && [[ "${KD_ALLOW_SPILLS:-0}" == 1 ]]; then
        echo "build.sh: KD_ALLOW_SPILLS=1: linking although a kernel spills"
    elif (( rc != 0 )); then
        echo "build.sh: ptxas resource check failed for $arch (build/cuda_resources.json; KD_ALLOW_SPILLS=1 links anyway)" >&2
        exit 1
    fi
fi

engine_objs=(); main_obj=""; test_obj=""; fuzz_obj=""; load_obj=""
for o in "${objects[@]}"; do
    case "$o" in
        */src_main.o) main_obj="$o" ;;
        */tests_test_ops.o) test_obj="$o" ;;
        */tests_fuzz.o) fuzz_obj="$o" ;;
        */bench_gpu_load.o) load_obj="$o" ;;
        *) engine_objs+=("$o") ;;
    esac
done
link() {  # link OUT OBJECTS...: when an object is newer than OUT or OUT was linked under another key
    local out="$1"; shift
    local need=0 o
    [[ -f "$out" && "$(cat "$out.key" 2>/dev/null || true)" == "$key" ]] || need=1
    for o in "$@"; do [[ "$o" -nt "$out" ]] && need=1; done
    (( need )) || return 0
    rm -f "$out.key"
    progress "linking $out"
    if [[ "$backend" == cuda ]]; then
        "$NVCC" ${nvccflags} "$@" -o "$out" $ldflags $libs
    else
        "$CXX" $cxxflags "$@" -o "$out" $ldflags
    fi
    echo "$key" > "$out.key"
    rebuilt+=("$out")
}
link build/kdtree "$main_obj" "${engine_objs[@]}" || { echo "build.sh: link failed: build/kdtree" >&2; exit 1; }
link build/test_ops "$test_obj" "${engine_objs[@]}" || { echo "build.sh: link failed: build/test_ops" >&2; exit 1; }
link build/fuzz "$fuzz_obj" "${engine_objs[@]}" || { echo "build.sh: link failed: build/fuzz" >&2; exit 1; }
if [[ -n "$load_obj" ]]; then
    link build/gpu_load "$load_obj" || { echo "build.sh: link failed: build/gpu_load" >&2; exit 1; }
fi

elapsed_ms=$(( ($(date +%s%N) - started_ns) / 1000000 ))
seconds=$(printf '%d.%03d' $((elapsed_ms / 1000)) $((elapsed_ms % 1000)))
rebuilt_json=""
for r in "${rebuilt[@]+"${rebuilt[@]}"}"; do rebuilt_json+="${rebuilt_json:+, }$(json_str "$r")"; done
cat > build/build_info.json <<JSON
{"version": 1, "tree": "$tree", "binary": "build/kdtree", "test_program": "build/test_ops",
 "key": $key,
 "rebuilt": [$rebuilt_json], "seconds": $seconds}
JSON
if (( cache_keep > 0 )) && { (( ${#rebuilt[@]} )) || ! have_all "$cached"; }; then
    mkdir -p "$cached"
    for b in "${binaries[@]}"; do cp -p "build/$b" "$cached/"; done
    [[ "$backend" != cuda ]] || cp -p build/cuda_resources.json "$cached/"
    touch "$cached"
fi
evict
echo "build.sh: $(build/kdtree --version) (${#rebuilt[@]} steps, ${seconds}s)"
