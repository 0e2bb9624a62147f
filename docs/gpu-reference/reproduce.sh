#!/usr/bin/env bash
# Validates this GPU machine as an ssh host of itself (lab.sh), the way a user validates ct200:
#   bash docs/gpu-reference/reproduce.sh OUTDIR [PART...]
# from the repo root. Parts (default: validate bare):
#   validate    every step of `invoke validate` on h200, benchmarks included: run.json, report.*, junit.xml
#   wide        the same with the k2wide tier beside the default one (--bundles default,k2wide): its two
#               bundles (28.6 GB) written on the host, golden-checked, tested and benchmarked
#   bare        doctor, deploy and validate (no bench) of h200-bare, the machine without rsync (tar stream)
#   contention  validate with the stress step instead of bench: the GPU under our own load generator
set -euo pipefail
out=$(realpath -m "${1:?usage: reproduce.sh OUTDIR [validate|wide|bare|contention ...]}")
shift
parts=("$@")
[ $# -gt 0 ] || parts=(validate bare)
cd "$(dirname "$0")/../.."
mkdir -p "$out"
# shellcheck source=docs/gpu-reference/lab.sh
. docs/gpu-reference/lab.sh

status=0
for part in "${parts[@]}"; do
  set -x
  case $part in
    validate)
      python3 -m invoke doctor --inventory "$inv" --host h200 || true
      python3 -m invoke validate --inventory "$inv" --host h200 --report-dir "$lab/run" || status=$?
      cp "$lab/run/run.json" "$lab/run/report.html" "$lab/run/report.md" "$lab/run/junit.xml" "$out/"
      tar -czf "$out/logs.tar.gz" -C "$lab" run/h200 ;;
    wide)
      python3 -m invoke validate --inventory "$inv" --host h200 --bundles default,k2wide --report-dir "$lab/wide" || status=$?
      cp "$lab/wide/run.json" "$lab/wide/report.html" "$lab/wide/report.md" "$lab/wide/junit.xml" "$out/"
      tar -czf "$out/logs.tar.gz" -C "$lab" wide/h200 ;;
    bare)
      python3 -m invoke doctor --inventory "$inv" --host h200-bare || true    # what the bare host lacks
      python3 -m invoke deploy --inventory "$inv" --host h200-bare || status=$?
      python3 -m invoke validate --inventory "$inv" --host h200-bare --skip bench --report-dir "$lab/run-bare" || status=$?
      cp "$lab/run-bare/run.json" "$out/run-bare.json"
      tar -czf "$out/logs-bare.tar.gz" -C "$lab" run-bare/h200-bare ;;
    contention)
      mkdir -p "$out/contention"
      python3 -m invoke validate --inventory "$inv" --host h200 \
          --steps preflight,sync,build,bundles,golden,test,stress --report-dir "$lab/contention" || status=$?
      cp "$lab/contention/run.json" "$lab/contention/report.html" "$lab/contention/report.md" \
         "$lab/contention/junit.xml" "$out/contention/" ;;
    *) echo "reproduce.sh: unknown part '$part' (validate, wide, bare, contention)" >&2; exit 2 ;;
  esac
  set +x
done
exit $status
