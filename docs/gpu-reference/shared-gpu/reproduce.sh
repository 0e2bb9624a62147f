#!/usr/bin/env bash
# The shared-GPU reference run: a CUDA process of "another user" holds memory on the GPU; then
#   gpu_policy: idle   refuses, naming that process's pid (preflight fails, exit 1),
#   gpu_policy: any    proceeds on the same GPU, and the bench step records the co-tenant (NOISY).
# Run on the GPU machine from the repo root (lab.sh makes it an ssh host of itself):
#   bash docs/gpu-reference/shared-gpu/reproduce.sh OUTDIR
set -euo pipefail
out=$(realpath -m "${1:?usage: reproduce.sh OUTDIR}")
cd "$(dirname "$0")/../../.."
mkdir -p "$out"
# shellcheck source=docs/gpu-reference/lab.sh
. docs/gpu-reference/lab.sh

# The inventory: h200 (gpu_policy idle, the default) and h200-any, one machine and one tree.
python3 - "$lab" <<'PY'
import sys, yaml
lab = sys.argv[1]
data = yaml.safe_load(open(f"{lab}/hosts.yaml"))
h200 = data["hosts"]["h200"]
data["hosts"] = {"h200": dict(h200, gpu_policy="idle", gpu_max_used_mib=1024),
                 "h200-any": dict(h200, gpu_policy="any")}
yaml.safe_dump(data, open(f"{lab}/shared.yaml", "w"), sort_keys=False)
PY
inv="$lab/shared.yaml"

# The co-tenant: 4 GiB held on the GPU until this script ends.
nvcc -O2 -o "$lab/hold_gpu" docs/gpu-reference/shared-gpu/hold_gpu.cu
"$lab/hold_gpu" 4096 > "$lab/hold_gpu.out" 2>&1 &
holder=$!
trap 'kill "$holder" 2>/dev/null || true' EXIT
for _ in $(seq 60); do grep -q holds "$lab/hold_gpu.out" && break; sleep 0.5; done
cat "$lab/hold_gpu.out"
nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits

set -x
python3 -m invoke doctor --inventory "$inv" --host h200 2>&1 | tee "$out/doctor.log" || true
status=0
# idle: refused in preflight, the message names the holder's pid
python3 -m invoke validate --inventory "$inv" --host h200 --report-dir "$lab/shared-idle" 2>&1 \
  | tee "$out/idle.txt" && status=1     # exit 0 here would be wrong
grep -q "pid $holder " "$lab/shared-idle/run.json" || { echo "the refusal does not name pid $holder" >&2; status=1; }
# any: the same GPU, every step; bench records the co-tenant
python3 -m invoke validate --inventory "$inv" --host h200-any --report-dir "$lab/shared-any" 2>&1 \
  | tee "$out/any.txt" || status=$?
set +x
cp "$lab/shared-idle/run.json" "$out/run-idle.json"
cp "$lab/shared-any/run.json" "$out/run-any.json"
cp "$lab/shared-any/report.md" "$out/report-any.md"
tar -czf "$out/logs.tar.gz" -C "$lab" shared-idle/h200 shared-any/h200-any
exit $status
