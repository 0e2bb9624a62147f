#!/usr/bin/env bash
# Collects ptxas resource usage (nvcc --resource-usage, one log per compiled .cu, whose first line
# is "source <path>") into one JSON report: per device function its registers, spill stores and
# loads, stack frame, static shared memory (dynamic shared memory is sized at launch, not here),
# barriers and ptxas compile time. Exits 1, naming each one,
# when any function spills (build.sh calls it after compiling; KD_ALLOW_SPILLS=1 there lets a
# spilling build link anyway), 2 on bad arguments or a log it cannot read.
#   scripts/cuda_resources.sh ARCH OUT_JSON LOG...
set -euo pipefail
(( $# >= 3 )) || { echo "usage: cuda_resources.sh ARCH OUT_JSON LOG..." >&2; exit 2; }
arch="$1" out="$2"; shift 2
for log in "$@"; do
    [[ -r "$log" ]] || { echo "cuda_resources.sh: cannot read $log" >&2; exit 2; }
    head -n1 "$log" | grep -q '^source ' || { echo "cuda_resources.sh: $log does not start with 'source <path>'" >&2; exit 2; }
done
demangle() { if command -v c++filt >/dev/null 2>&1; then c++filt; else cat; fi; }

# One tab-separated row per function: source, symbol, entry, registers, barriers, smem, stack,
# spill stores, spill loads, ptxas ms. The lines ptxas prints per function, in this order:
#   Compiling entry function '<sym>' for 'sm_XX'        (kernels only)
#   Function properties for <sym>
#       <n> bytes stack frame, <n> bytes spill stores, <n> bytes spill loads
#   Used <n> registers, used <n> barriers, <n> bytes smem, ...   (kernels only)
#   Compile time = <ms> ms                                        (kernels only)
rows="$(awk '
    function flush() { if (sym != "") print src "\t" sym "\t" entry "\t" regs "\t" bars "\t" smem "\t" stack "\t" st "\t" ld "\t" ms; sym = "" }
    FNR == 1 { flush(); src = $2; next }
    /Compiling entry function/ { flush(); match($0, /function .[^'"'"']*/); pending = substr($0, RSTART + 10, RLENGTH - 10); next }
    /Function properties for / { flush(); sym = $NF; entry = (sym == pending) ? "true" : "false"
                                 regs = "null"; bars = "null"; smem = "null"; stack = 0; st = 0; ld = 0; ms = "null"; next }
    /bytes stack frame/ { for (i = 1; i <= NF; i++) { if ($(i+1) == "bytes" && $(i+2) == "stack") stack = $i
                                                      if ($(i+1) == "bytes" && $(i+2) == "spill" && $(i+3) ~ /^stores/) st = $i
                                                      if ($(i+1) == "bytes" && $(i+2) == "spill" && $(i+3) ~ /^loads/) ld = $i }
                          next }
    /ptxas info *: Used / { smem = 0   # ptxas names static shared memory only when there is some
                            for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^registers/) regs = $i
                                                        if ($(i+1) ~ /^barriers/) bars = $i
                                                        if ($(i+1) == "bytes" && $(i+2) ~ /^smem/) smem = $i }
                            next }
    /Compile time = / { ms = $(NF-1); next }
    END { flush() }
' "$@")"

json_str() { local s="${1//\\/\\\\}"; s="${s//\"/\\\"}"; printf '"%s"' "$s"; }
spills=() items=()
while IFS=$'\t' read -r src sym entry regs bars smem stack st ld ms; do
    [[ -n "$sym" ]] || continue
    name="$(printf '%s\n' "$sym" | demangle)"
    items+=("{\"source\": $(json_str "$src"), \"function\": $(json_str "$name"), \"symbol\": $(json_str "$sym"), \"kernel\": $entry, \"registers\": $regs, \"barriers\": $bars, \"smem_bytes\": $smem, \"stack_bytes\": $stack, \"spill_stores\": $st, \"spill_loads\": $ld, \"ptxas_ms\": $ms}")
    (( st == 0 && ld == 0 )) || spills+=("$name ($src): $st bytes spill stores, $ld bytes spill loads")
done <<<"$rows"
(( ${#items[@]} )) || { echo "cuda_resources.sh: no function found in $* (was nvcc run with --resource-usage?)" >&2; exit 2; }
{
    printf '{"version": 1, "arch": %s, "spilling": %d, "functions": [\n' "$(json_str "$arch")" "${#spills[@]}"
    sep=""
    for item in "${items[@]}"; do printf '%s %s' "$sep" "$item"; sep=$',\n'; done
    printf '\n]}\n'
} >"$out.tmp" && mv -f "$out.tmp" "$out"
if (( ${#spills[@]} )); then
    for s in "${spills[@]}"; do echo "cuda_resources.sh: $arch: $s" >&2; done
    echo "cuda_resources.sh: ${#spills[@]} function(s) spill registers for $arch (report: $out)" >&2
    exit 1
fi
echo "cuda_resources.sh: ${#items[@]} device functions for $arch, none spills ($out)"
