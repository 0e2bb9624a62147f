#!/usr/bin/env bash
# k2wide on the GPU host: build, write both bundles (placeholder golden), AR and DDTree == AR on CUDA
cd engine_src || exit 1
export PATH=/usr/local/cuda/bin:$PATH CUDA_HOME=/usr/local/cuda
t0=$(date +%s)
bash scripts/build.sh > "$OUT/build.log" 2>&1; echo "build rc=$? $(( $(date +%s) - t0 ))s"; tail -2 "$OUT/build.log"
t1=$(date +%s)
python3 python/gen_model.py --out /tmp/k2 --configs k2wide --golden ../.xfer/placeholder_golden.json > "$OUT/gen.log" 2>&1
echo "write rc=$? $(( $(date +%s) - t1 ))s"; grep -v kdtree-progress "$OUT/gen.log" | tail -3; grep kdtree-progress "$OUT/gen.log" | tail -2
ls -la /tmp/k2; free -g | head -2; df -h /tmp | tail -1
mem=$(python3 -c "import json; m=json.load(open('/tmp/k2/manifest.json')); print(max(b['needs']['ram_bytes'] for b in m['bundles']))")
echo "max-memory $mem"
for q in int4 fp32; do
  b=/tmp/k2/model_k2wide_$q.kdtr
  t=$(date +%s); build/kdtree generate --backend cuda --max-memory "$mem" --bundle "$b" -n 64 2>&1 | tail -3; echo "generate-$q $(( $(date +%s) - t ))s"
  for bb in "16 8" "48 8"; do read -r budget block <<<"$bb"
    t=$(date +%s); build/kdtree check --backend cuda --max-memory "$mem" --bundle "$b" --expect ar --mode ddtree --budget "$budget" --block "$block" -n 64 2>&1 | tail -2; echo "ddtree-$q-B$budget $(( $(date +%s) - t ))s"
  done
done
t=$(date +%s); build/kdtree verify --bundle /tmp/k2/model_k2wide_int4.kdtr 2>&1 | tail -1; echo "verify $(( $(date +%s) - t ))s"
