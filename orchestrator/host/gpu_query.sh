# shellcheck shell=bash
# The GPU query (gpus.query_command): $1 the most bytes kept of each query's output, $2 and $3 the
# GPU and compute-app queries, $4 the format, then folders where nvidia-smi may be when it is not on
# PATH. Prints `smi PATH` (or `smi -`), then tagged lines (gpu/app, err-gpu/err-app, rc) for gpus.parse_query.

max=$1 qgpu=$2 qapp=$3 fmt=$4; shift 4
smi=$(command -v nvidia-smi 2>/dev/null)
case $smi in /*) ;; *) smi=;; esac
if [ -z "$smi" ]; then
  for d in "$@"; do [ -x "$d/nvidia-smi" ] && [ -f "$d/nvidia-smi" ] && { smi=$d/nvidia-smi; break; }; done
fi
[ -n "$smi" ] || { echo "smi -"; exit 0; }
printf 'smi %s\n' "$smi"
err=$(mktemp) || exit 1
trap 'rm -f -- "$err"' EXIT
run() {
  local tag=$1 out rc; shift
  out=$("$smi" "$@" 2>"$err" | head -c "$max"; exit "${PIPESTATUS[0]}")
  rc=$?
  [ -n "$out" ] && printf '%s\n' "$out" | sed "s/^/$tag /"
  head -c 4096 -- "$err" | sed "s/^/err-$tag /"
  echo "rc $tag $rc"
}
run gpu "$qgpu" "$fmt"
run app "$qapp" "$fmt"
exit 0
