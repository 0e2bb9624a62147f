#!/usr/bin/env bash
# The engine's test suite: op tests for every backend in the build (build/test_ops), then model
# tests on every bundle: AR == golden, engine == Python reference on prompts outside the
# bundles, DDTree == AR over budgets and block sizes (mean acceptance > 1), INT4 golden != FP32,
# the same on k2small (tests/small_k2.py: k2wide's kinds of bundle at a tiny width, AR and DDTree
# == the float64 reference), an altered golden token is caught, the long-context golden catches an engine without YaRN or
# the group limit, bad bundles are rejected, every reproducer of
# tests/fuzz/regress ends as it should (and, with KD_FUZZ_SECONDS, a bounded fuzz run finds
# nothing). KD_SANITIZE=1 runs all of it on the ASan + UBSan build. One line per test, and a
# progress report after it (python/kdtree_ref/progress.py); ends with
# "ALL TESTS PASSED" or "N TESTS FAILED" (exit 1); writes $KD_RESULTS_DIR/test_results.json
# (default build/; or $KD_TEST_RESULTS). Builds first (incrementally) and regenerates missing
# bundles with $PYTHON (into $KD_BUNDLE_DIR, default tests/refs, as scripts/bundles.sh does),
# unless KD_NO_BUILD is set: then the build and the bundles are used as they are (several runs at
# once, one per GPU, share them).
#   KD_TEST_BACKENDS  comma-separated backends to test (default: every backend of the build)
#   KD_TEST_BUNDLES   comma-separated bundle names: the per-bundle model tests run on these only, each
#                     other bundle recorded as one skipped test (default: every bundle of the manifest)
#   KD_TEST_RESULTS   the results file (default $KD_RESULTS_DIR/test_results.json)
#   KD_GPU_LOAD       SHAPES[@SHARE] (scripts/gpu_load.sh): the op and model tests run with
#                     build/gpu_load on the GPU, recorded as load.gpu_load (skipped without a GPU)
set -euo pipefail
engine="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$engine"
PYTHON="${PYTHON:-python3}"
refs="${KD_BUNDLE_DIR:-tests/refs}"   # where scripts/bundles.sh writes them
manifest="$refs/manifest.json"
results="${KD_RESULTS_DIR:-build}"
kdtree=build/kdtree
# KD_MAX_MEMORY (bytes): the engine's --max-memory for the model tests (the orchestrator sets it
# from the bundles' declared RAM need; default: the engine's own 4 GiB)
mem=()
if [[ -n "${KD_MAX_MEMORY:-}" ]]; then mem=(--max-memory "$KD_MAX_MEMORY"); fi
scratch="$(mktemp -d)"
source scripts/gpu_load.sh
# An unexpected error or a signal (a timeout's TERM) stops the suite, but never without its
# results file: the stop is a failed case naming the line or signal and the status, beside every
# case recorded before it. A results file of an earlier run is removed first, so that a suite
# killed outright leaves none rather than another run's.
results_file="${KD_TEST_RESULTS:-$results/test_results.json}"
rm -f "$results_file"
finished=0
stopped_at=""
trap 'stopped_at="line $LINENO"' ERR
trap 'stopped_at="SIGTERM"; exit 143' TERM
trap 'stopped_at="SIGINT"; exit 130' INT
cleanup() {
    local rc=$?
    if (( !finished )); then
        record suite.stopped failed 0 "run_tests.sh stopped early with status $rc${stopped_at:+ ($stopped_at)}: the cases after it did not run"
        write_results "${build_backend:-unknown}"
        echo "$failed TESTS FAILED (the suite stopped early)"
    fi
    [[ -z "$GPU_LOAD_PID" ]] || gpu_load_stop || true
    rm -rf "$scratch"
}
trap cleanup EXIT

records=()
passed=0; failed=0; skipped=0
json_str() {  # a JSON string literal of $1
    local s="${1//\\/\\\\}"
    s="${s//\"/\\\"}"; s="${s//$'\n'/\\n}"; s="${s//$'\t'/\\t}"; s="${s//$'\r'/}"
    printf '"%s"' "$s"
}
record() {  # record NAME STATUS SECONDS MESSAGE
    local name="$1" status="$2" seconds="$3" message="${4:0:400}"
    case "$status" in
        passed) passed=$((passed + 1)); printf 'PASS  %-52s %6ss  %s\n' "$name" "$seconds" "$message" ;;
        failed) failed=$((failed + 1)); printf 'FAIL  %-52s %6ss  %s\n' "$name" "$seconds" "$message" ;;
        skipped) skipped=$((skipped + 1)); printf 'SKIP  %-52s %6ss  %s\n' "$name" "$seconds" "$message" ;;
    esac
    records+=("{\"name\": $(json_str "$name"), \"status\": \"$status\", \"seconds\": $seconds, \"message\": $(json_str "$message")}")
    # a progress report (python/kdtree_ref/progress.py): the suite's size shows only as it runs, so no total
    echo "::kdtree-progress done=$((passed + failed + skipped)) unit=tests what=$passed passed, $failed failed, $skipped skipped: $name"
}
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
secs() { local ms=$(( $(now_ms) - $1 )); printf '%d.%03d' $((ms / 1000)) $((ms % 1000)); }
# check NAME CMD...: passes when CMD exits 0; the message is the last line of its output.
check() {
    local name="$1"; shift
    local t0 out rc=0
    t0=$(now_ms)
    out="$("$@" 2>&1)" || rc=$?
    if (( rc == 0 )); then record "$name" passed "$(secs "$t0")" "$(tail -n1 <<<"$out")"
    else record "$name" failed "$(secs "$t0")" "exit $rc: $(tail -n3 <<<"$out" | tr '\n' ' ')"; fi
}
# expect_failure NAME PATTERN CMD...: passes when CMD exits non-zero and its output matches PATTERN.
expect_failure() {
    local name="$1" pattern="$2"; shift 2
    local t0 out rc=0
    t0=$(now_ms)
    out="$("$@" 2>&1)" || rc=$?
    if (( rc != 0 )) && grep -qE "$pattern" <<<"$out"; then
        record "$name" passed "$(secs "$t0")" "rejected as expected: $(head -n1 <<<"$out")"
    else
        record "$name" failed "$(secs "$t0")" "expected a failure matching '$pattern', got exit $rc: $(head -n2 <<<"$out" | tr '\n' ' ')"
    fi
}
write_results() {
    local backend="$1" body="" r
    for r in "${records[@]+"${records[@]}"}"; do body+="${body:+,$'\n'  }$r"; done
    local file="$results_file"
    mkdir -p "$(dirname "$file")"
    printf '{"version": 1, "backend": "%s", "passed": %d, "failed": %d, "skipped": %d, "tests": [\n  %s\n]}\n' \
        "$backend" "$passed" "$failed" "$skipped" "$body" > "$file"
}
# refuse MESSAGE: the setup asked for cannot run (exit 2, no results file: nothing was tested).
refuse() {
    finished=1
    echo "$1" >&2
    exit 2
}
finish() {
    finished=1
    write_results "$1"
    if (( failed )); then echo "$failed TESTS FAILED"; exit 1; fi
    echo "ALL TESTS PASSED"
    exit 0
}

# ---- build and bundles ---------------------------------------------------------------------
built() {  # the build as it is (KD_NO_BUILD): both binaries must be there
    [[ -x "$kdtree" && -x build/test_ops ]] || { echo "build/kdtree or build/test_ops is missing and KD_NO_BUILD is set"; return 1; }
    echo "using the existing build (KD_NO_BUILD)"
}
if [[ -n "${KD_NO_BUILD:-}" ]]; then check build built; else check build bash scripts/build.sh; fi
if [[ ! -x "$kdtree" || ! -x build/test_ops ]]; then finish unknown; fi
build_backend="$(sed -n 's/.* backend=\([a-z]*\) .*/\1/p' <<<"$("$kdtree" --version)")"
backends=(cpu)
[[ "$build_backend" == cuda ]] && backends+=(cuda)
# ASan's shadow gap protection and the CUDA driver's mappings do not mix.
if [[ "${KD_SANITIZE:-0}" == 1 && "$build_backend" == cuda ]]; then export ASAN_OPTIONS="protect_shadow_gap=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"; fi

bundles_missing=0
[[ -f "$manifest" ]] || bundles_missing=1
if (( ! bundles_missing )); then
    for f in $("$PYTHON" -c 'import json,sys; print(" ".join(b["file"] for b in json.load(open(sys.argv[1]))["bundles"]))' "$manifest"); do
        [[ -f "$refs/$f" ]] || bundles_missing=1
    done
fi
if (( bundles_missing )) && [[ -n "${KD_NO_BUILD:-}" ]]; then
    record bundles.regenerate failed 0 "bundles missing under $refs and KD_NO_BUILD is set"
    finish "$build_backend"
elif (( bundles_missing )); then
    check bundles.regenerate bash scripts/bundles.sh
    [[ -f "$manifest" ]] || finish "$build_backend"
fi

# The CUDA backend of a CUDA build that cannot start: on a machine with no GPU (a compile check)
# only the CPU backend is tested; where the GPU was asked for (KD_TEST_BACKENDS names cuda,
# KD_BACKEND=cuda, or nvidia-smi lists a GPU) that is a failure naming the cause (a co-tenant
# holding the GPU's memory, exclusive-process mode), never a pass on the CPU backend alone.
cuda_asked() {
    [[ ",${KD_TEST_BACKENDS:-}," == *",cuda,"* ]] && { echo "KD_TEST_BACKENDS=$KD_TEST_BACKENDS"; return; }
    [[ "${KD_BACKEND:-auto}" == cuda ]] && { echo "KD_BACKEND=cuda"; return; }
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null |
        grep -q '^GPU-' && { echo "nvidia-smi lists a GPU"; return; }
    return 1
}
if [[ "$build_backend" == cuda ]]; then
    probe="$(build/test_ops --backend cuda 2>&1 | grep '^skip cuda' || true)"
    if [[ -n "$probe" ]]; then
        if asked="$(cuda_asked)"; then
            record backend.cuda failed 0 "the CUDA backend was asked for ($asked) and could not start: ${probe#skip cuda.\* }"
        else
            record backend.cuda skipped 0 "${probe#skip cuda.\* }"
        fi
        backends=(cpu)
    fi
fi

if [[ -n "${KD_TEST_BACKENDS:-}" ]]; then
    chosen=()
    for be in ${KD_TEST_BACKENDS//,/ }; do
        case "$be" in
            cpu) chosen+=(cpu) ;;
            cuda) [[ "$build_backend" == cuda ]] || refuse "run_tests.sh: KD_TEST_BACKENDS names cuda, but this is a $build_backend build"
                  if [[ " ${backends[*]} " == *" cuda "* ]]; then chosen+=(cuda); fi ;;  # else recorded as skipped above
            *) refuse "run_tests.sh: KD_TEST_BACKENDS: unknown backend '$be' (cpu, cuda)" ;;
        esac
    done
    backends=("${chosen[@]+"${chosen[@]}"}")
fi

# Under load: the generator runs from here to the end of the model tests.
if [[ -n "${KD_GPU_LOAD:-}" ]]; then
    if [[ " ${backends[*]+"${backends[*]}"} " != *" cuda "* ]]; then
        record load.gpu_load skipped 0 "KD_GPU_LOAD=$KD_GPU_LOAD: no CUDA backend is tested here, so nothing runs under load"
    elif ! gpu_load_start "$KD_GPU_LOAD" "$scratch/gpu_load.log"; then
        record load.gpu_load failed 0 "KD_GPU_LOAD=$KD_GPU_LOAD: build/gpu_load did not start, the tests below ran without load: $(tail -n 2 "$scratch/gpu_load.log" | tr '\n' ' ')"
    fi
fi
load_t0=$(now_ms)

# name file config quant how golden... of every bundle, one per line; how: "streamed" for a big
# config's bundle (gen_model's writer records its generator key: k2wide, 13-15 GB), else "memory"
bundle_list="$("$PYTHON" -c '
import json, sys
m = json.load(open(sys.argv[1]))
streamed = m["generator"].get("keys", {})
for b in m["bundles"]:
    how = "streamed" if b["config"] in streamed else "memory"
    print(b["name"], b["file"], b["config"], b["quant"], how, ",".join(map(str, b["golden"])))' "$manifest")"

# KD_TEST_BUNDLES: every name must be a bundle of the manifest (a typo must not select nothing)
selected_bundle() { [[ -z "${KD_TEST_BUNDLES:-}" || ",${KD_TEST_BUNDLES}," == *",$1,"* ]]; }
if [[ -n "${KD_TEST_BUNDLES:-}" ]]; then
    names=" $(awk '{printf "%s ", $1}' <<<"$bundle_list")"
    [[ -n "${KD_TEST_BUNDLES//,/}" ]] || refuse "run_tests.sh: KD_TEST_BUNDLES='$KD_TEST_BUNDLES' names no bundle (its bundles:$names)"
    for want in ${KD_TEST_BUNDLES//,/ }; do
        [[ "$names" == *" $want "* ]] || refuse "run_tests.sh: KD_TEST_BUNDLES names '$want', which is not a bundle of $manifest (its bundles:$names)"
    done
fi

# ---- op tests: one line of build/test_ops per test ------------------------------------------
for be in "${backends[@]}"; do
    t0=$(now_ms)
    rc=0
    out="$(build/test_ops --backend "$be" 2>&1)" || rc=$?
    seconds="$(secs "$t0")"
    n_lines=0 n_failed=0
    while read -r status name detail; do
        case "$status" in
            ok) record "ops.$name" passed "$seconds" "$detail"; n_lines=$((n_lines + 1)) ;;
            FAIL) record "ops.$name" failed "$seconds" "$detail"; n_lines=$((n_lines + 1)); n_failed=$((n_failed + 1)) ;;
            skip) record "ops.$name" skipped "$seconds" "$detail"; n_lines=$((n_lines + 1)) ;;
        esac
    done <<<"$out"
    (( n_lines > 0 )) || record "ops.$be" failed "$seconds" "test_ops printed no results: $(tail -n2 <<<"$out" | tr '\n' ' ')"
    # An exit that no FAIL line explains (an abort, a signal) stopped the tests part-way.
    if (( n_lines > 0 && rc != 0 && n_failed == 0 )); then
        record "ops.$be.exit" failed "$seconds" "test_ops exited with status $rc after $n_lines results: $(tail -n2 <<<"$out" | tr '\n' ' ')"
    fi
done

# ---- model tests ------------------------------------------------------------------------------
for be in "${backends[@]}"; do
    while read -r name file _ _ how golden; do
        if ! selected_bundle "$name"; then
            record "model.$be.$name" skipped 0 "not selected: KD_TEST_BUNDLES=$KD_TEST_BUNDLES"
            continue
        fi
        bundle="$refs/$file"
        # The bundle's own golden tokens (prompt from the bundle, n = golden length).
        check "model.$be.$name.ar_equals_golden" "$kdtree" check "${mem[@]}" --backend "$be" --bundle "$bundle" --expect golden
        # The manifest's golden tokens, the list the orchestrator compares against. A streamed (big)
        # bundle's writer copies them into its header, so that header is compared with the manifest
        # instead of a second engine run (each reads its 13-15 GB again): the run above was against them.
        if [[ "$how" == streamed ]]; then
            check "model.$be.$name.ar_equals_manifest_golden" "$PYTHON" - "$bundle" "$golden" <<'PY'
import sys
sys.path.insert(0, "python")
from kdtree_ref import kdtr
from gen_model import first_difference
path, listed = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
header = list(kdtr.read(path, lazy=True).header["golden"])
if header != listed:
    sys.exit(f"{path}: its golden tokens differ from the manifest's at token {first_difference(header, listed)}")
print("the bundle's golden tokens are the manifest's (header read): ar_equals_golden ran against them")
PY
        else
            check "model.$be.$name.ar_equals_manifest_golden" "$kdtree" check "${mem[@]}" --backend "$be" --bundle "$bundle" --expect "$golden"
        fi
        if [[ "$how" == streamed && "$be" == cpu && " ${backends[*]} " == *" cuda "* ]]; then
            # A big bundle's DDTree runs on the GPU; on the CPU backend beside it, the golden alone
            # (minutes at this width; the kernels the two share nothing of are checked by the ops tests).
            record "model.$be.$name.ddtree" skipped 0 "a streamed (big) bundle: DDTree == AR is checked on the cuda backend"
            continue
        fi
        budgets=("4 2" "8 8" "16 4" "48 8")
        # a streamed (big) bundle: two budgets (every engine run reads its 13-15 GB again: about 25 s)
        [[ "$how" == streamed ]] && budgets=("16 8" "48 8")
        for bl in "${budgets[@]}"; do
            read -r budget block <<<"$bl"
            check "model.$be.$name.ddtree_equals_ar.B${budget}_L${block}" "$kdtree" check "${mem[@]}" --backend "$be" --bundle "$bundle" \
                --expect ar --mode ddtree --budget "$budget" --block "$block" -n 64
        done
        # Prompts in no bundle: engine == the float64 reference (kdtree_ref) up to the first near-tie.
        if [[ "$how" == streamed ]]; then
            record "model.$be.$name.reference_prompts" skipped 0 "a streamed (big) bundle: the float64 reference takes about 15 CPU-minutes a trajectory at its width; its golden tokens are that reference's (golden_search.py)"
            continue
        fi
        t0=$(now_ms)
        if ref="$("$PYTHON" tests/ref_tokens.py "$bundle" --prompts 2 -n 24 2>&1)"; then
            i=0
            while read -r prompt tokens; do
                check "model.$be.$name.reference_prompt$i" "$kdtree" check "${mem[@]}" --backend "$be" --bundle "$bundle" --prompt "$prompt" --expect "$tokens"
                check "model.$be.$name.reference_prompt$i.ddtree" "$kdtree" check "${mem[@]}" --backend "$be" --bundle "$bundle" --prompt "$prompt" \
                    --expect "$tokens" --mode ddtree --budget 16
                i=$((i + 1))
            done < <("$PYTHON" -c '
import json, sys
for e in json.loads(sys.argv[1]): print(",".join(map(str, e["prompt"])), ",".join(map(str, e["tokens"])))' "$ref")
        else
            record "model.$be.$name.reference_prompts" failed "$(secs "$t0")" "tests/ref_tokens.py failed: $(tail -n2 <<<"$ref" | tr '\n' ' ')"
        fi
    done <<<"$bundle_list"
done

# ---- k2small: k2wide's shapes of bundle at a tiny width (tests/small_k2.py, made here, not committed) ------
# Routed experts made directly as INT4, the keep_fp32 twin, the lowrank_head drafter and YaRN with
# beta_fast == beta_slow: AR equals the float64 reference's tokens (the golden), and so does DDTree,
# also at budget 2 where its random drafter accepts nothing (mean acceptance 1: judged only of a
# fitted drafter, negative.ddtree_low_acceptance_of_a_fitted_drafter below).
t0=$(now_ms)
if small="$("$PYTHON" tests/small_k2.py "$scratch/k2small" 2>&1)"; then
    for be in "${backends[@]}"; do
        while read -r name file _; do
            check "model.$be.$name.ar_equals_reference" "$kdtree" check --backend "$be" --bundle "$scratch/k2small/$file" --expect golden
            for bl in "2 8" "32 8" "48 4"; do
                read -r budget block <<<"$bl"
                check "model.$be.$name.ddtree_equals_reference.B${budget}_L${block}" "$kdtree" check --backend "$be" \
                    --bundle "$scratch/k2small/$file" --expect golden --mode ddtree --budget "$budget" --block "$block"
            done
        done <<<"$small"
    done
else
    record model.k2small failed "$(secs "$t0")" "tests/small_k2.py failed: $(tail -n2 <<<"$small" | tr '\n' ' ')"
fi

if [[ -n "$GPU_LOAD_PID" ]]; then
    if gpu_load_stop; then
        record load.gpu_load passed "$(secs "$load_t0")" "the op and model tests above ran under KD_GPU_LOAD=$KD_GPU_LOAD: $GPU_LOAD_SUMMARY"
    else
        record load.gpu_load failed "$(secs "$load_t0")" "build/gpu_load stopped before the tests ended, so not all of them ran under load: $GPU_LOAD_SUMMARY"
    fi
fi

# ---- the manifest: what was regenerated is what is committed; quantisation leaves a trace ------
check manifest.matches_expected "$PYTHON" - "$manifest" tests/refs/expected_manifest.json <<'PY'
import json, os, sys
sys.path.insert(0, "python")
from kdtree_ref import kdtr
import gen_model
got, want = (json.load(open(p)) for p in sys.argv[1:3])
have = {b["name"]: b for b in got["bundles"]}
# the expected bundles of the configs asked for (scripts/bundles.sh: KD_CONFIGS, else the default run's)
asked = os.environ.get("KD_CONFIGS", "").split() or gen_model.DEFAULT_CONFIGS
want["bundles"] = [w for w in want["bundles"] if w["config"] in asked]
for w in want["bundles"]:
    g = have.get(w["name"])
    if g is None:
        sys.exit(f"bundle {w['name']} is in the expected manifest but was not generated")
    for key in ("file", "sha256", "golden"):
        if g[key] != w[key]:
            sys.exit(f"bundle {w['name']}: {key} differs from tests/refs/expected_manifest.json")
    # the bundle's identity: v1 the file's sha256, v2 its digest over header and index (each tensor's hash: the engine's load)
    digest = kdtr.read(f"{sys.argv[1].rsplit('/', 1)[0]}/{g['file']}", lazy=True).identity()
    if digest != g["sha256"]:
        sys.exit(f"bundle {w['name']}: {g['file']} has sha256 {digest[:16]}..., the manifest says {g['sha256'][:16]}...")
print(f"{len(want['bundles'])} bundles: files, sha256 and golden tokens match the expected manifest")
PY

for config in $(awk '{print $3}' <<<"$bundle_list" | sort -u); do
    fp32="$(awk -v c="$config" '$3 == c && $4 == "fp32" {print $6}' <<<"$bundle_list")"
    int4="$(awk -v c="$config" '$3 == c && $4 == "int4" {print $6}' <<<"$bundle_list")"
    if [[ -z "$fp32" || -z "$int4" ]]; then record "manifest.$config.int4_differs_from_fp32" skipped 0 "needs both an fp32 and an int4 bundle"
    elif [[ "$fp32" != "$int4" ]]; then record "manifest.$config.int4_differs_from_fp32" passed 0 "INT4 golden differs from FP32 golden"
    else record "manifest.$config.int4_differs_from_fp32" failed 0 "INT4 golden equals FP32 golden: the quantisation left no trace"; fi
done

# ---- the checks can fail ----------------------------------------------------------------------
read -r _ first_file _ <<<"$bundle_list"
# rewrite_bundle SRC DST MODE [KEY [VALUE]]: a copy of a version 1 bundle with its header or data changed
# (golden | missing | bounds | nan | unknown_key | extra_layer | config: config KEY (a.b for a nested one) set
# to the JSON VALUE, or removed without one), its data_sha256 recomputed so that the change is the only
# defect; or with one defect of the file itself (data_sha256: a data byte flipped | trailing: a byte appended).
rewrite_bundle() {
    "$PYTHON" - "$@" <<'PY'
import hashlib, json, struct, sys
src, dst, mode = sys.argv[1:4]
blob = open(src, "rb").read()
n = struct.unpack_from("<Q", blob, 8)[0]
header = json.loads(blob[16:16 + n])
data = blob[(16 + n + 63) // 64 * 64:]
if mode == "golden":      # one golden token altered
    k = len(header["golden"]) // 2
    header["golden"][k] = (header["golden"][k] + 1) % header["config"]["vocab_size"]
elif mode == "missing":   # the tensor table lacks the final norm
    header["tensors"] = [t for t in header["tensors"] if t["name"] != "norm"]
elif mode == "bounds":    # the head's bytes point past the end of the data section
    for t in header["tensors"]:
        if t["name"] == "head":
            t["offset"] = (len(data) + 63) // 64 * 64
elif mode == "nan":       # one weight of the final norm is NaN
    t = next(t for t in header["tensors"] if t["name"] == "norm")
    data = data[:t["offset"]] + struct.pack("<f", float("nan")) + data[t["offset"] + 4:]
elif mode == "unknown_key":   # a top-level header key the format does not have
    header["comment"] = "x"
elif mode == "extra_layer":   # one layer fewer in the config: the last layer's tensors are extra
    header["config"]["n_layers"] -= 1
elif mode == "mask_drafter":  # a linear drafter that drafts the mask token (in no prompt or golden) first everywhere
    vocab = header["config"]["vocab_size"]
    for t in header["tensors"]:
        if t["name"] == "drafter.w":
            data = data[:t["offset"]] + bytes(t["nbytes"]) + data[t["offset"] + t["nbytes"]:]
        if t["name"] == "drafter.b":
            rows = b"".join(struct.pack("<f", 1e3 if v == vocab - 1 else 0.0) for v in range(vocab)) * (t["nbytes"] // (4 * vocab))
            data = data[:t["offset"]] + rows + data[t["offset"] + t["nbytes"]:]
elif mode == "data_sha256":   # one data byte flipped, data_sha256 left as it was
    data = data[:-1] + bytes([data[-1] ^ 1])
elif mode == "config":    # one config field changed or removed
    *path, last = sys.argv[4].split(".")
    obj = header["config"]
    for key in path:
        obj = obj[key]
    if len(sys.argv) > 5:
        obj[last] = json.loads(sys.argv[5])
    else:
        del obj[last]
if mode not in ("data_sha256", "trailing"):
    header["data_sha256"] = hashlib.sha256(data).hexdigest()
text = json.dumps(header, separators=(",", ":")).encode()
pad = (16 + len(text) + 63) // 64 * 64 - 16 - len(text)
open(dst, "wb").write(blob[:8] + struct.pack("<Q", len(text)) + text + b"\0" * pad + data + (b"\0" if mode == "trailing" else b""))
PY
}
altered="$scratch/altered_$first_file"
rewrite_bundle "$refs/$first_file" "$altered" golden
expect_failure "negative.altered_golden_token_detected" "MISMATCH" "$kdtree" check --bundle "$altered" --expect golden
rewrite_bundle "$refs/$first_file" "$scratch/missing.kdtr" missing
expect_failure "negative.loader_missing_tensor" "missing.kdtr: missing tensor norm" "$kdtree" generate --bundle "$scratch/missing.kdtr" -n 2
rewrite_bundle "$refs/$first_file" "$scratch/bounds.kdtr" bounds
expect_failure "negative.loader_tensor_out_of_bounds" "bounds.kdtr: tensor head out of bounds" "$kdtree" generate --bundle "$scratch/bounds.kdtr" -n 2
rewrite_bundle "$refs/$first_file" "$scratch/nan.kdtr" nan
expect_failure "negative.loader_nan_weight" "nan.kdtr: tensor norm: element 0 is not finite" "$kdtree" generate --bundle "$scratch/nan.kdtr" -n 2
printf 'KDTR\x03\x00\x00\x00' > "$scratch/version3.kdtr"; tail -c +9 "$refs/$first_file" >> "$scratch/version3.kdtr"
expect_failure "negative.loader_bad_version" "version3.kdtr: unsupported version 3" "$kdtree" generate --bundle "$scratch/version3.kdtr" -n 2
head -c 16 "$refs/$first_file" > "$scratch/not_json.kdtr"; printf '{"config": [' >> "$scratch/not_json.kdtr"
tail -c +29 "$refs/$first_file" >> "$scratch/not_json.kdtr"
expect_failure "negative.loader_header_not_json" "not_json.kdtr: bad header, not JSON" "$kdtree" generate --bundle "$scratch/not_json.kdtr" -n 2
printf 'NOTK' > "$scratch/bad_magic.kdtr"; tail -c +5 "$refs/$first_file" >> "$scratch/bad_magic.kdtr"
expect_failure "negative.loader_bad_magic" "bad_magic.kdtr: bad magic" "$kdtree" generate --bundle "$scratch/bad_magic.kdtr" -n 2
head -c "$(( $(stat -c %s "$refs/$first_file") / 2 ))" "$refs/$first_file" > "$scratch/truncated.kdtr"
expect_failure "negative.loader_truncated" "truncated.kdtr: truncated" "$kdtree" generate --bundle "$scratch/truncated.kdtr" -n 2
# The bundle is exactly what its header says (format strictness, both versions).
# DDTree == AR alone does not pass a fitted drafter that accepts nothing (a random lowrank_head one: k2small above)
rewrite_bundle "$refs/$first_file" "$scratch/mask_drafter.kdtr" mask_drafter
expect_failure "negative.ddtree_low_acceptance_of_a_fitted_drafter" "LOW ACCEPTANCE .*accept_mean=1.000" "$kdtree" check \
    --bundle "$scratch/mask_drafter.kdtr" --expect ar --mode ddtree --budget 1 -n 32
rewrite_bundle "$refs/$first_file" "$scratch/data_sha256.kdtr" data_sha256
expect_failure "negative.loader_data_sha256" "data_sha256.kdtr: data_sha256 mismatch" "$kdtree" generate --bundle "$scratch/data_sha256.kdtr" -n 2
rewrite_bundle "$refs/$first_file" "$scratch/trailing.kdtr" trailing
expect_failure "negative.loader_bytes_after_the_data" "trailing.kdtr: 1 bytes after the data section" "$kdtree" generate --bundle "$scratch/trailing.kdtr" -n 2
rewrite_bundle "$refs/$first_file" "$scratch/unknown_key.kdtr" unknown_key
expect_failure "negative.loader_unknown_header_key" "unknown_key.kdtr: bad header: unknown top-level key 'comment'" "$kdtree" generate --bundle "$scratch/unknown_key.kdtr" -n 2
rewrite_bundle "$refs/$first_file" "$scratch/extra_layer.kdtr" extra_layer
expect_failure "negative.loader_extra_layer_tensor" "extra_layer.kdtr: extra tensor layers\.[0-9]+\.attn_norm" "$kdtree" generate --bundle "$scratch/extra_layer.kdtr" -n 2

# ---- format version 2: v2 copies (python/kdtr_convert.py) decode the golden tokens on every backend; every
# defect of the index is refused by name ---------------------------------------------------------------------------
v2_files="$(awk '$4 == "fp32" && !f {print $2; f = 1}' <<<"$bundle_list") $(awk '$4 == "int4" && !f {print $2; f = 1}' <<<"$bundle_list")"
# verify_identity FILE WANT: `kdtree verify` passes FILE and names WANT as its identity.
verify_identity() {
    local out
    out="$("$kdtree" verify --bundle "$1")" || return 1
    [[ "$out" == *"identity $2" ]] || { echo "kdtree verify said: $out; expected identity $2"; return 1; }
    echo "$out"
}
check "format_v1.verify.${first_file%.kdtr}" verify_identity "$refs/$first_file" "$(sha256sum "$refs/$first_file" | cut -c1-64)"
# verify_upload FILE BACKEND: `kdtree verify --upload` puts FILE's weights in BACKEND's memory and says how long it took.
verify_upload() {
    local out
    out="$("$kdtree" verify --bundle "$1" --upload --backend "$2")" || return 1
    [[ "$out" =~ uploaded\ to\ $2\ in\ [0-9.]+\ s\ \([0-9.]+\ GB/s\ of\ weights\) ]] || { echo "kdtree verify --upload said: $out"; return 1; }
    echo "$out"
}
for be in "${backends[@]}"; do check "format_v1.verify_upload.$be.${first_file%.kdtr}" verify_upload "$refs/$first_file" "$be"; done
expect_failure "negative.loader_not_a_regular_file" "bundle .*: cannot read the file \(not a regular file\)" "$kdtree" verify --bundle "$scratch"
expect_failure "negative.loader_missing_file" "bundle .*/no_such_file\.kdtr: cannot open the file: No such file or directory \(errno 2\)" \
    "$kdtree" verify --bundle "$scratch/no_such_file.kdtr"
for file in $v2_files; do
    check "format_v2.convert.${file%.kdtr}" "$PYTHON" python/kdtr_convert.py "$refs/$file" "$scratch/v2_$file"
    check "format_v2.verify.${file%.kdtr}" verify_identity "$scratch/v2_$file" "$(tail -c 32 "$scratch/v2_$file" | od -An -tx1 | tr -d ' \n')"
    for be in "${backends[@]}"; do
        check "format_v2.$be.${file%.kdtr}.ar_equals_golden" "$kdtree" check --backend "$be" --bundle "$scratch/v2_$file" --expect golden
        check "format_v2.$be.${file%.kdtr}.ddtree_equals_ar" "$kdtree" check --backend "$be" --bundle "$scratch/v2_$file" \
            --expect ar --mode ddtree --budget 16 -n 16
    done
done
v2_base="$scratch/v2_${v2_files%% *}"
for defect in "tensor_hash tensor .*: sha256 .* differs from the index's" "digest bundle digest mismatch" \
              "count index count mismatch: the index holds" "magic bad index magic" "trailing 32 bytes after the index" \
              "truncated truncated: the index ends at" "data_sha256 bad header: unknown top-level key 'data_sha256'"; do
    read -r what pattern <<<"$defect"
    # Without its base (its conversion failed above) no defect file is made, and the case below
    # fails naming the missing file.
    "$PYTHON" - "$v2_base" "$scratch/v2_$what.kdtr" "$what" <<'PY' || rm -f "$scratch/v2_$what.kdtr"
import hashlib, json, struct, sys
src, dst, what = sys.argv[1:4]
blob = bytearray(open(src, "rb").read())
n = struct.unpack_from("<Q", blob, 8)[0]
header = json.loads(blob[16:16 + n])
start = (16 + n + 63) // 64 * 64
index = (start + header["data_bytes"] + 63) // 64 * 64
if what == "tensor_hash":     # one byte of the last tensor
    blob[start + header["data_bytes"] - 1] ^= 1
elif what == "digest":        # the digest's last byte
    blob[-1] ^= 1
elif what == "count":         # the index's count one higher
    struct.pack_into("<I", blob, index + 4, len(header["tensors"]) + 1)
elif what == "magic":
    blob[index] ^= 1
elif what == "trailing":      # another 32 bytes after the digest
    blob += bytes(32)
elif what == "truncated":     # the digest's last byte missing
    del blob[-1]
elif what == "data_sha256":   # a v1 key in a v2 header (and the digest made to match)
    header["data_sha256"] = "0" * 64
    text = json.dumps(header, separators=(",", ":")).encode()
    prefix = blob[:8] + struct.pack("<Q", len(text)) + text
    prefix += bytes(-len(prefix) % 64)
    blob = prefix + blob[start:]
    blob[-32:] = hashlib.sha256(bytes(prefix) + bytes(blob[index - start + len(prefix):-32])).digest()
open(dst, "wb").write(blob)
PY
    expect_failure "negative.v2_$what" "v2_$what.kdtr: $pattern" "$kdtree" generate --bundle "$scratch/v2_$what.kdtr" -n 2
done

# A long-context golden (a bundle with YaRN RoPE scaling) catches what it exists for: the same
# bundle without the scaling, without its softmax-scale correction, with the original context
# of DeepSeek-V3 (4096: no position of the prompt past it) or without the group limit decodes
# other tokens.
yarn_file="$("$PYTHON" - "$manifest" <<'PY'
import json, sys
sys.path.insert(0, "python")
from kdtree_ref import kdtr
refs = sys.argv[1].rsplit("/", 1)[0]
for b in json.load(open(sys.argv[1]))["bundles"]:
    try:
        header = kdtr.read(f"{refs}/{b['file']}").header
    except kdtr.KdtrError:  # a damaged bundle: its own cases above fail, naming the defect
        continue
    if header["config"].get("rope_scaling"):
        print(b["file"])
        break
PY
)"
if [[ -n "$yarn_file" ]]; then
    groups="$("$PYTHON" -c 'import sys; sys.path.insert(0, "python"); from kdtree_ref import kdtr; print(kdtr.read(sys.argv[1]).header["config"]["n_expert_groups"])' "$refs/$yarn_file")"
    for change in "no_rope_scaling rope_scaling" "no_softmax_correction rope_scaling.mscale_all_dim 0" \
                  "original_context_4096 rope_scaling.original_max_position_embeddings 4096" "no_group_limit n_limited_groups $groups"; do
        read -r what key value <<<"$change"
        rewrite_bundle "$refs/$yarn_file" "$scratch/$what.kdtr" config "$key" ${value:+"$value"}
        expect_failure "negative.long_context_$what" "MISMATCH" "$kdtree" check --bundle "$scratch/$what.kdtr" --expect golden
    done
else
    record negative.long_context skipped 0 "no bundle with RoPE scaling in $manifest"
fi

# ---- input hardening: every reproducer in tests/fuzz/regress ends as its `expect:` line says ------
t0=$(now_ms)
replay="$(build/fuzz replay --refs "$refs" tests/fuzz/regress/*.case 2>&1)" || true
seconds="$(secs "$t0")"
n_lines=0
while read -r status file seconds detail; do
    name="regress.$(basename "$file" .case)"
    case "$status" in
        ok) record "$name" passed "$seconds" "$detail"; n_lines=$((n_lines + 1)) ;;
        FAIL) record "$name" failed "$seconds" "$detail"; n_lines=$((n_lines + 1)) ;;
    esac
done <<<"$replay"
(( n_lines > 0 )) || record regress.replay failed "$seconds" "build/fuzz replay printed no results: $(tail -n2 <<<"$replay" | tr '\n' ' ')"

# ---- a bounded fuzz run (KD_FUZZ_SECONDS > 0; findings go to build/fuzz_findings) ---------------
if [[ "${KD_FUZZ_SECONDS:-0}" != 0 ]]; then
    check fuzz.run build/fuzz run --refs "$refs" --seconds "$KD_FUZZ_SECONDS" --cases 1000000 \
        --seed "${KD_FUZZ_SEED:-1}" --findings build/fuzz_findings
fi

finish "$build_backend"
