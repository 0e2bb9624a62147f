# scripts/gpu_load.sh: sourced (not run) by scripts/run_tests.sh and bench/gpu_validate.sh to put
# GPU work under a co-tenant: build/gpu_load (bench/gpu_load.cu, built by scripts/build.sh in
# CUDA builds) runs in the background from gpu_load_start until gpu_load_stop.
# A LOAD is `SHAPES[@SHARE]`: SHAPES as gpu_load's --shape (compute, mma, memory, burst, pulse,
# comma-separated, or cycle), SHARE its --share (default 1).
# Expects the current directory to be engine_src/.

GPU_LOAD_PID=""
GPU_LOAD_LOG=""
GPU_LOAD_SUMMARY=""

# gpu_load_start LOAD LOG: starts the generator (output to LOG) and waits, at most 30 s, until
# its first unit of work has run. Fails, with the generator stopped, when it does not get there.
gpu_load_start() {
    local load="$1" log="$2" shapes share i
    shapes="${load%%@*}"
    share=1
    [[ "$load" == *@* ]] && share="${load#*@}"
    rm -f "$log.ready"
    build/gpu_load --shape "$shapes" --share "$share" --ready "$log.ready" >"$log" 2>&1 &
    GPU_LOAD_PID=$!
    GPU_LOAD_LOG="$log"
    for ((i = 0; i < 300; i++)); do
        [[ -f "$log.ready" ]] && return 0
        kill -0 "$GPU_LOAD_PID" 2>/dev/null || break
        sleep 0.1
    done
    gpu_load_stop || true
    return 1
}

# gpu_load_stop: stops the generator started by gpu_load_start and sets GPU_LOAD_SUMMARY to the
# last line of its output (its summary, or its error). Fails when it was no longer running (so
# the work since gpu_load_start did not all run under load) or did not stop cleanly.
# Call it in the shell that started the generator (not in $(...)): only that shell can wait for it.
gpu_load_stop() {
    if [[ -z "$GPU_LOAD_PID" ]]; then GPU_LOAD_SUMMARY="gpu_load: not started"; return 1; fi
    local alive=0 rc=0
    kill -0 "$GPU_LOAD_PID" 2>/dev/null && alive=1
    kill -TERM "$GPU_LOAD_PID" 2>/dev/null || true
    wait "$GPU_LOAD_PID" || rc=$?
    GPU_LOAD_PID=""
    rm -f "$GPU_LOAD_LOG.ready"
    GPU_LOAD_SUMMARY="$(tail -n 1 "$GPU_LOAD_LOG")"
    (( alive && rc == 0 ))
}
