// cli_bench.cpp: `kdtree bench`: tokens/s AR vs DDTree on the bundles, per-layer timings, and a
// K2-width MoE layer (random weights) in FP32 and INT4. Writes the README's bench.json.
#include "args.h"
#include "backend.h"
#include "bundle.h"
#include "cli.h"
#include "decode.h"
#include "json.h"
#include "manifest.h"
#include "version.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <stdexcept>

namespace kd {
namespace {

double now_seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Over a repeat, the process's CPU time / wall time (its CPU share) is the cores it kept busy: a
// share that drops between runs means other processes took the cores, and a figure per CPU
// second (a rate / share, a time x share: the work per CPU second) leaves their cost out. A
// single-threaded repeat has a share of at most 1, one that splits its matmuls over threads
// (backend_cpu.cpp) can exceed it. Decoding counts its own CPU seconds (Generation); a
// Stopwatch covers what does not.
struct Stopwatch {
    double wall = now_seconds(), cpu = cpu_seconds();
    double share() const {  // since construction
        const double w = now_seconds() - wall, c = cpu_seconds() - cpu;
        return w > 0 && c > 0 ? c / w : 1.0;
    }
};

double median_of(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double mad_of(const std::vector<double>& v) {
    const double m = median_of(v);
    std::vector<double> d;
    for (double x : v) d.push_back(std::fabs(x - m));
    return median_of(d);
}

// The calibration probe: a fixed workload of this file's own (no backend, no model code, so no
// change to the engine's decoding or kernels moves it) with the bundles' memory behaviour: matrix-
// vector products with 8 independent sums (bound by the caches' bandwidth, as the backend's are,
// not by an add's latency), 4 passes over an 8 MiB matrix (the size of a small bundle's weights:
// in the L3 cache on a quiet machine, evicted by other processes on a busy one, as a bundle's
// weights are between two tokens) and 8 passes over a 512 KiB part of it (a core's L2). It runs
// once at the start and after every repeat of every timing; a repeat's calibration is the mean of
// the probe's CPU seconds just before and just after it. Cache and memory contention from other processes cost CPU seconds to the
// probe as to the repeat beside it, so a metric's ratio to the probe measured beside it
// (`cal_samples`, in the metric's own terms) keeps what the code did and cancels what the machine
// did. Off (no probe runs, nothing recorded) on a GPU backend.
class Probe {
public:
    explicit Probe(bool on) : on_(on) {
        if (!on_) return;
        w_.resize(static_cast<size_t>(kRows) * kCols);
        x_.resize(kCols);
        uint32_t s = 12345;
        for (float& v : w_) v = static_cast<float>((s = s * 1664525u + 1013904223u) >> 8) * 1e-7f;
        for (float& v : x_) v = static_cast<float>((s = s * 1664525u + 1013904223u) >> 8) * 1e-7f;
        last_ = run();
    }
    // After a repeat: the probe's CPU seconds around it (the mean of the runs just before and just
    // after it); 0 when off.
    double next() {
        if (!on_) return 0.0;
        const double now = run();
        const double around = (last_ + now) / 2;
        last_ = now;
        all_.push_back(now);
        return around;
    }
    // What bench.json's details say of the probe: its runs, their median CPU milliseconds, and the
    // products' sum (written out, so the compiler cannot drop the work).
    Json summary() const {
        Json j = Json::object();
        j.set("runs", static_cast<int>(all_.size())).set("cpu_ms_median", all_.empty() ? 0.0 : 1e3 * median_of(all_));
        return j.set("checksum", sink_);
    }

private:
    static constexpr int kRows = 1024, kCols = 2048, kPasses = 4, kHotRows = 64, kHotPasses = 8;
    double run() {
        const double c0 = cpu_seconds();
        float acc = 0;
        for (int pass = 0; pass < kPasses + kHotPasses; ++pass) {
            const int rows = pass < kPasses ? kRows : kHotRows;
            for (int r = 0; r < rows; ++r) {
                const float* row = w_.data() + static_cast<size_t>(r) * kCols;
                float sums[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int c = 0; c < kCols; c += 8)
                    for (int l = 0; l < 8; ++l) sums[l] += row[c + l] * x_[c + l];
                for (float v : sums) acc += v;
            }
        }
        sink_ += acc;
        return cpu_seconds() - c0;
    }
    bool on_;
    std::vector<float> w_, x_;
    std::vector<double> all_;
    double last_ = 0, sink_ = 0;
};

// A probe's per-repeat CPU seconds in the terms of a rate (probe runs per CPU second); a time's
// are its CPU milliseconds, a speed-up's the ratio of two rates.
std::vector<double> probe_rates(const std::vector<double>& seconds) {
    std::vector<double> out;
    for (double s : seconds) out.push_back(s > 0 ? 1.0 / s : 0.0);
    return out;
}

// A metric with what a reader needs to judge its noise: every repeat's sample, their median and
// MAD (median absolute deviation); `noisy` marks timings whose noise the machine adds (CPU
// timings: other processes share the cores). A CPU timing also carries each repeat's figure per
// CPU second (`cpu_samples`), the calibration probe's figure beside each of those repeats in the
// same terms (`cal_samples`, same length) and its repeats' median CPU share (`cpu_share`).
Json metric(double value, const std::string& unit, const std::string& better,
            const std::vector<double>& samples = {}, bool noisy = false,
            std::vector<double> cpu_samples = {}, const std::vector<double>& shares = {},
            std::vector<double> cal_samples = {}) {
    // a span too short for the CPU clock to see has no figure per CPU second (nor a ratio to the probe)
    const auto seen = [](double v) { return std::isfinite(v) && v > 0; };
    const bool paired = cal_samples.size() == cpu_samples.size();
    std::vector<double> kept, kept_cal;
    for (size_t i = 0; i < cpu_samples.size(); ++i) {
        if (!seen(cpu_samples[i]) || (paired && !seen(cal_samples[i]))) continue;
        kept.push_back(cpu_samples[i]);
        if (paired) kept_cal.push_back(cal_samples[i]);
    }
    cpu_samples = kept;
    cal_samples = paired ? kept_cal : std::vector<double>{};
    Json m = Json::object();
    m.set("value", value).set("unit", unit).set("better", better);
    if (!samples.empty()) {
        m.set("samples", Json::array_of(samples)).set("n", static_cast<int>(samples.size()));
        m.set("median", median_of(samples)).set("mad", mad_of(samples));
    }
    if (noisy) m.set("noisy", true);
    if (!cpu_samples.empty()) m.set("cpu_samples", Json::array_of(cpu_samples));
    if (!cal_samples.empty()) m.set("cal_samples", Json::array_of(cal_samples));
    if (!shares.empty()) m.set("cpu_share", median_of(shares));
    return m;
}


// One run of a timing (a sample): its generation run back to back, on one model, until the run
// has lasted --min-time-ms (once when 0), its figures those of its best generation on each clock
// (the most tokens per second, and per CPU second). A tiny bundle decodes in a few milliseconds,
// and on a shared machine most of its generations are slowed by something else (another
// process's turn on the core, its evictions from the caches): the best of many short ones is
// the one least disturbed, as Python's timeit advises. Measured before choosing
// (docs/benchmarks/, the issue 23 record): between nights under load the best of 15 generations per CPU second
// moved 0.2-5 %, the median of 5 single-generation runs 1.7-12.7 %, and runs of 250 ms summed
// (autorange alone: every disturbance averaged in) 3.8-10.7 %; the best kept the step of a 15 %
// slower commit at 0.84-0.87x on every night. The run's CPU share is over all its generations.
struct Sample {
    Generation first;  // the first generation (its tokens, per-step counters and acceptance)
    double seconds = 0, cpu_seconds = 0;  // summed over the generations
    double tokens_per_s = 0, decode_tokens_per_s = 0, prefill_tokens_per_s = 0;  // the best generation's
    double cpu_tokens_per_s = 0, cpu_decode_tokens_per_s = 0, cpu_prefill_tokens_per_s = 0;
    double prefill_seconds = 0, prefill_cpu_seconds = 0;
    int generations = 0;

    void add(const Generation& g, size_t prompt) {
        if (generations++ == 0) first = g;
        seconds += g.prefill_seconds + g.decode_seconds;
        cpu_seconds += g.prefill_cpu_seconds + g.decode_cpu_seconds;
        prefill_seconds += g.prefill_seconds;
        prefill_cpu_seconds += g.prefill_cpu_seconds;
        tokens_per_s = std::max(tokens_per_s, g.tokens_per_second());
        decode_tokens_per_s = std::max(decode_tokens_per_s, g.decode_tokens_per_second());
        prefill_tokens_per_s = std::max(prefill_tokens_per_s, g.prefill_tokens_per_second(prompt));
        cpu_tokens_per_s = std::max(cpu_tokens_per_s, g.tokens_per_cpu_second());
        cpu_decode_tokens_per_s = std::max(cpu_decode_tokens_per_s, g.decode_tokens_per_cpu_second());
        cpu_prefill_tokens_per_s = std::max(cpu_prefill_tokens_per_s, g.prefill_tokens_per_cpu_second(prompt));
    }
    double tokens_per_second() const { return tokens_per_s; }
    double decode_tokens_per_second() const { return decode_tokens_per_s; }
    double prefill_tokens_per_second() const { return prefill_tokens_per_s; }
    double cpu_share() const { return seconds > 0 ? cpu_seconds / seconds : 0.0; }
};

// A timing's runs so far: the best (least disturbed) one, every run's tokens/s
// (whole, decode, prefill), the same per CPU second, and its CPU share (the prefill's only for
// runs with a prefill time).
struct Repeats {
    Sample best;
    std::vector<double> generations, seconds;  // each run's generations (1 without --min-time-ms) and their seconds
    std::vector<double> tokens_per_s, decode_tokens_per_s, prefill_tokens_per_s, shares, prefill_shares;
    std::vector<double> cpu_tokens_per_s, cpu_decode_tokens_per_s, cpu_prefill_tokens_per_s;
    std::vector<double> probe_seconds, prefill_probe_seconds;  // the probe beside each run (CPU backend)
};

// One more run of a timing (AR, or DDTree with `budget` > 0) into `r`, lasting at least
// `min_time` seconds of generation (Sample), with the probe after it.
// The model's upload time goes to `uploads`.
void run_once(Backend& be, Probe& probe, const Bundle& b, const std::vector<int32_t>& prompt, int n, int budget,
              double min_time, Repeats& r, std::vector<double>& uploads) {
    Model model(b, be, budget > 0 ? batch_rows_needed(prompt.size(), budget) : static_cast<int>(prompt.size()));
    uploads.push_back(model.upload_seconds());
    Sample s;
    do {
        const Generation g = budget > 0 ? generate_ddtree(model, prompt, n, budget, b.drafter_block) : generate_ar(model, prompt, n);
        if (s.generations > 0 && g.tokens != s.first.tokens)
            throw std::runtime_error("bench: bundle " + printable(b.path, 200) + " decoded other tokens when run again on the same model");
        s.add(g, prompt.size());
    } while (s.seconds < min_time);
    r.tokens_per_s.push_back(s.tokens_per_s);
    r.decode_tokens_per_s.push_back(s.decode_tokens_per_s);
    r.cpu_tokens_per_s.push_back(s.cpu_tokens_per_s);
    r.cpu_decode_tokens_per_s.push_back(s.cpu_decode_tokens_per_s);
    r.shares.push_back(s.cpu_share());
    r.generations.push_back(s.generations);
    r.seconds.push_back(s.seconds);
    if (s.prefill_seconds > 0) {
        r.prefill_tokens_per_s.push_back(s.prefill_tokens_per_s);
        r.cpu_prefill_tokens_per_s.push_back(s.cpu_prefill_tokens_per_s);
        r.prefill_shares.push_back(s.prefill_cpu_seconds / s.prefill_seconds);
    }
    r.probe_seconds.push_back(probe.next());
    if (s.prefill_seconds > 0) r.prefill_probe_seconds.push_back(r.probe_seconds.back());
    if (r.tokens_per_s.size() == 1 || s.tokens_per_second() > r.best.tokens_per_second()) r.best = s;
}

// Run by run: over[r] / under[r] (the runs of two timings in the same round, side by side in time).
std::vector<double> paired(const std::vector<double>& over, const std::vector<double>& under) {
    std::vector<double> out;
    for (size_t i = 0; i < over.size() && i < under.size(); ++i) out.push_back(under[i] > 0 ? over[i] / under[i] : 0.0);
    return out;
}

// A decode step's cost (an AR token, or a DDTree round: draft, verify, accept): wall time and
// what the backend queued (backend.h BackendCounters), per step of the decode after the prefill.
Json per_step(const Generation& g) {
    const int steps = g.accepted.empty() ? g.forwards : static_cast<int>(g.accepted.size());
    const double n = std::max(steps, 1);
    const BackendCounters& k = g.decode_counters;
    Json j = Json::object();
    j.set("steps", steps).set("us", g.decode_seconds * 1e6 / n).set("kernels", k.kernels / n);
    j.set("launches", k.launches / n).set("graph_launches", k.graph_launches / n);
    j.set("h2d", k.h2d / n).set("d2h", k.d2h / n).set("d2d", k.d2d / n).set("copies", (k.h2d + k.d2h + k.d2d) / n);
    j.set("syncs", k.syncs / n);
    return j;
}

void print_step(const char* what, const Json& j) {
    std::printf("    %s per step: %8.1f us, %6.1f kernels, %6.1f launches (%4.1f graphs), %5.1f copies (h2d %4.1f d2h %4.1f d2d %4.1f), %4.1f syncs\n",
                what, j.at("us").as_number(), j.at("kernels").as_number(), j.at("launches").as_number(),
                j.at("graph_launches").as_number(), j.at("copies").as_number(), j.at("h2d").as_number(),
                j.at("d2h").as_number(), j.at("d2d").as_number(), j.at("syncs").as_number());
}

// What a CPU timing adds to its metric: its figures per CPU second, the shares and the probe's
// figures beside them (nothing on a GPU).
struct CpuView {
    std::vector<double> samples, shares, cal;
};

// A bundle's runs so far: AR, DDTree per budget, and the profiled AR decodes (every run's MoE FFN
// milliseconds, the same x the run's CPU share, the probe around it, and the per-layer table of
// the run with the least MoE FFN time).
struct BundleRuns {
    const Bundle* bundle = nullptr;
    std::string name;
    int n = 0;
    Repeats ar;
    std::vector<Repeats> trees;  // one per budget
    std::vector<double> moe_ffn_ms, moe_ffn_cpu_ms, moe_ffn_probe_ms;
    Json layers = Json::array();
    std::vector<double> upload_seconds;  // every model built for the bundle: its weights' upload
};

// Per-layer time of one AR decode, each part synchronised, into the bundle's runs.
void profile_once(Backend& be, Probe& probe, BundleRuns& runs) {
    const Bundle& b = *runs.bundle;
    Model model(b, be, static_cast<int>(b.prompt.size()));
    runs.upload_seconds.push_back(model.upload_seconds());
    model.profile = true;
    const Stopwatch watch;
    const Generation g = generate_ar(model, b.prompt, runs.n);
    const double share = watch.share();
    const double per_forward = 1e3 / (g.forwards + 1);
    Json run = Json::array();
    double moe = 0;
    for (size_t i = 0; i < model.times.attention.size(); ++i) {
        const bool dense = static_cast<int>(i) < b.config.n_dense_layers;
        Json l = Json::object();
        l.set("layer", static_cast<int>(i)).set("kind", dense ? "dense" : "moe");
        l.set("attention_ms", model.times.attention[i] * per_forward).set("ffn_ms", model.times.ffn[i] * per_forward);
        run.push(l);
        if (!dense) moe += model.times.ffn[i] * per_forward;
    }
    if (runs.moe_ffn_ms.empty() || moe < *std::min_element(runs.moe_ffn_ms.begin(), runs.moe_ffn_ms.end())) runs.layers = run;
    runs.moe_ffn_ms.push_back(moe);
    runs.moe_ffn_cpu_ms.push_back(moe * share);
    runs.moe_ffn_probe_ms.push_back(probe.next() * 1e3);
}

// One round of a bundle: one run of AR, of DDTree at each budget, and of the profiled decode.
// The bench runs its repeats in rounds over every bundle, so that a burst of contention on the
// machine falls on one run of each timing, not on all the runs of the bundles measured then.
void bundle_round(Backend& be, Probe& probe, const std::vector<int>& budgets, double min_time, BundleRuns& runs) {
    const Bundle& b = *runs.bundle;
    run_once(be, probe, b, b.prompt, runs.n, 0, min_time, runs.ar, runs.upload_seconds);
    runs.trees.resize(budgets.size());
    for (size_t i = 0; i < budgets.size(); ++i)
        run_once(be, probe, b, b.prompt, runs.n, budgets[i], min_time, runs.trees[i], runs.upload_seconds);
    profile_once(be, probe, runs);
}

// A bundle's metrics and details from its runs.
Json bench_bundle(Backend& be, const BundleRuns& runs, const std::vector<int>& budgets, Json& metrics) {
    const Bundle& b = *runs.bundle;
    const std::string& name = runs.name;
    const int n = runs.n;
    Json out = Json::object();
    const bool noisy = be.name() == "cpu";
    const Repeats& ar_runs = runs.ar;
    const Sample& ar = ar_runs.best;
    const auto cpu = [&](const std::vector<double>& rates, const std::vector<double>& shares, const std::vector<double>& cal) {
        return noisy ? CpuView{rates, shares, cal} : CpuView{};
    };
    const auto timed = [&](double value, const std::string& unit, const std::vector<double>& samples, const CpuView& v) {
        return metric(value, unit, "higher", samples, noisy, v.samples, v.shares, v.cal);
    };
    // A speed-up's samples are paired by round: DDTree's run r over AR's run r, on the wall clock,
    // per CPU second, and for the probe beside them. The two runs of a round are seconds apart, so
    // a burst of load that slows a whole round cancels out of the ratio; over the best AR run
    // instead, a round whose AR run was fast and whose DDTree run was starved read as a 30 %
    // slower speed-up (measured: two false alarms in 20 nights under load, none with the pairing
    // replayed on the same runs).
    const std::vector<double> ar_cal = probe_rates(ar_runs.probe_seconds);
    Json arj = Json::object();
    arj.set("tokens_per_second", ar.tokens_per_second()).set("n", n).set("prefill_seconds", ar.first.prefill_seconds);
    arj.set("decode_seconds", ar.first.decode_seconds).set("decode_tokens_per_second", ar.decode_tokens_per_second());
    arj.set("generations", Json::array_of(ar_runs.generations)).set("run_seconds", Json::array_of(ar_runs.seconds));
    arj.set("prompt_tokens", static_cast<int>(b.prompt.size()));
    const Json ar_step = per_step(ar.first);
    arj.set("per_step", ar_step);
    out.set("ar", arj);
    metrics.set(name + ".ar_tokens_per_s", timed(ar.tokens_per_second(), "tokens/s", ar_runs.tokens_per_s,
                                                 cpu(ar_runs.cpu_tokens_per_s, ar_runs.shares, ar_cal)));
    // Decode alone (after the prompt): at long context the prefill would hide what DDTree saves.
    metrics.set(name + ".ar_decode_tokens_per_s", timed(ar.decode_tokens_per_second(), "tokens/s", ar_runs.decode_tokens_per_s,
                                                        cpu(ar_runs.cpu_decode_tokens_per_s, ar_runs.shares, ar_cal)));
    metrics.set(name + ".prefill_tokens_per_s",
                timed(ar.prefill_tokens_per_second(), "tokens/s", ar_runs.prefill_tokens_per_s,
                      cpu(ar_runs.cpu_prefill_tokens_per_s, ar_runs.prefill_shares, probe_rates(ar_runs.prefill_probe_seconds))));
    Json trees = Json::array();
    double best_speedup = 0, best_accept = 0, best_decode = 0;
    Json best_step = Json::object();
    double best_speedup_accept = 0;  // the mean acceptance at the best speed-up's budget
    std::vector<double> best_speedups, best_decodes;  // every repeat of the best budget
    CpuView best_speedups_cpu, best_decodes_cpu, best_decode_speedups_cpu;
    for (size_t bi = 0; bi < budgets.size(); ++bi) {
        const int budget = budgets[bi];
        const Repeats& tree = runs.trees[bi];
        const std::vector<double> cal = probe_rates(tree.probe_seconds);
        const Sample& g = tree.best;
        Json t = Json::object();
        t.set("budget", budget).set("block", b.drafter_block).set("tokens_per_second", g.tokens_per_second());
        t.set("accept_mean", g.first.accept_mean()).set("rounds", static_cast<int>(g.first.accepted.size()));
        t.set("speedup_over_ar", g.tokens_per_second() / ar.tokens_per_second());
        t.set("decode_tokens_per_second", g.decode_tokens_per_second());
        t.set("equals_ar", g.first.tokens == ar.first.tokens).set("generations", Json::array_of(tree.generations)).set("run_seconds", Json::array_of(tree.seconds));
        const Json step = per_step(g.first);
        t.set("per_step", step);
        trees.push(t);
        if (g.tokens_per_second() / ar.tokens_per_second() > best_speedup) {
            best_speedup = g.tokens_per_second() / ar.tokens_per_second();
            best_step = step;
            best_speedup_accept = g.first.accept_mean();
            best_speedups = paired(tree.tokens_per_s, ar_runs.tokens_per_s);
            best_speedups_cpu = cpu(paired(tree.cpu_tokens_per_s, ar_runs.cpu_tokens_per_s), tree.shares, paired(cal, ar_cal));
        }
        best_accept = std::max(best_accept, g.first.accept_mean());
        if (g.decode_tokens_per_second() > best_decode) {
            best_decode = g.decode_tokens_per_second();
            best_decodes = tree.decode_tokens_per_s;
            best_decodes_cpu = cpu(tree.cpu_decode_tokens_per_s, tree.shares, cal);
            best_decode_speedups_cpu = cpu(paired(tree.cpu_decode_tokens_per_s, ar_runs.cpu_decode_tokens_per_s), tree.shares, paired(cal, ar_cal));
        }
        std::printf("  %s ddtree budget %3d: %8.1f tokens/s (AR %8.1f), decode %8.1f tokens/s (AR %8.1f), accept_mean %.2f\n",
                    name.c_str(), budget, g.tokens_per_second(), ar.tokens_per_second(), g.decode_tokens_per_second(),
                    ar.decode_tokens_per_second(), g.first.accept_mean());
    }
    out.set("ddtree", trees);
    metrics.set(name + ".ddtree_best_speedup", timed(best_speedup, "x", best_speedups, best_speedups_cpu));
    metrics.set(name + ".ddtree_best_decode_tokens_per_s", timed(best_decode, "tokens/s", best_decodes, best_decodes_cpu));
    const bool decoded = ar.decode_tokens_per_second() > 0;
    metrics.set(name + ".ddtree_best_decode_speedup",
                timed(decoded ? best_decode / ar.decode_tokens_per_second() : 0.0, "x",
                      decoded ? paired(best_decodes, ar_runs.decode_tokens_per_s) : std::vector<double>{},
                      decoded ? best_decode_speedups_cpu : CpuView{}));
    metrics.set(name + ".accept_mean_best", metric(best_accept, "tokens", "higher"));
    if (!noisy && best_step.has("us")) {
        print_step("AR", ar_step);
        print_step("DDTree at the best budget", best_step);
        // Where launches and copies are counted (a GPU): the cost of a step, and how far the
        // speed-up is below the acceptance (1 would be a round as cheap as an AR step).
        metrics.set(name + ".ar_us_per_step", metric(ar_step.at("us").as_number(), "us", "lower"));
        metrics.set(name + ".ar_launches_per_step", metric(ar_step.at("launches").as_number(), "launches", "lower"));
        metrics.set(name + ".ddtree_best_us_per_step", metric(best_step.at("us").as_number(), "us", "lower"));
        metrics.set(name + ".ddtree_best_launches_per_step", metric(best_step.at("launches").as_number(), "launches", "lower"));
        metrics.set(name + ".ddtree_best_copies_per_step", metric(best_step.at("copies").as_number(), "copies", "lower"));
        metrics.set(name + ".ddtree_best_accept_over_speedup", metric(best_speedup_accept / best_speedup, "x", "lower"));
    }

    // Per-layer times: the table of the profiled run with the least MoE FFN time, and every run's
    // MoE FFN total (its samples).
    out.set("layers_ms_per_forward", runs.layers);
    out.set("moe_ffn_ms", Json::array_of(runs.moe_ffn_ms));
    if (noisy) out.set("moe_ffn_cpu_ms", Json::array_of(runs.moe_ffn_cpu_ms)).set("moe_ffn_probe_ms", Json::array_of(runs.moe_ffn_probe_ms));
    out.set("quant", b.int4 ? "int4" : "fp32");

    // The bundle's load (its one read and check, every model's upload), as `kdtree verify` prints it.
    std::vector<double> uploads = runs.upload_seconds;
    std::sort(uploads.begin(), uploads.end());
    const double upload = uploads.empty() ? -1 : uploads[uploads.size() / 2];
    std::printf("  load: %s (the median of %zu models)\n", load_phases(b, be.name(), upload).c_str(), uploads.size());
    Json load = Json::object();
    load.set("bytes", static_cast<long long>(b.bytes.size())).set("weight_bytes", static_cast<long long>(b.weight_bytes));
    load.set("read_seconds", b.read_seconds).set("read_threads", static_cast<int>(b.read_threads)).set("check_seconds", b.check_seconds);
    load.set("upload_seconds", Json::array_of(runs.upload_seconds));
    out.set("load", load);
    return out;
}

// Uploads n values from a SplitMix64 stream: uniform floats in [-scale, scale], or raw int32
// words (random nibbles) when `words`.
void upload_random(Backend& be, void* dst, size_t n, uint64_t seed, float scale, bool words) {
    std::vector<uint32_t> host(n);
    uint64_t s = seed;
    for (uint32_t& v : host) {
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        if (words) {
            v = static_cast<uint32_t>(z);
        } else {
            const float f = (static_cast<float>(z >> 40) / 16777216.0f * 2.0f - 1.0f) * scale;
            std::memcpy(&v, &f, 4);
        }
    }
    be.upload(dst, host.data(), n * 4);
}

// One K2-width MoE FFN (router, routed experts, shared expert) for M tokens, FP32 or INT4, as the
// model runs it: the shared expert stacked after the routed ones (ExpertWeights::shared).
Json bench_moe_layer(Backend& be, Probe& probe, int n_experts, const std::vector<int>& token_counts, int repeats, double min_time,
                     Json& metrics) {
    const int D = 7168, I = 2048, top_k = 8;
    if (n_experts < top_k) throw std::runtime_error("--moe-experts must be at least 8 (top-8 routing)");
    const size_t per = static_cast<size_t>(I) * D;
    const int M_max = *std::max_element(token_counts.begin(), token_counts.end());
    std::vector<void*> owned;
    const auto alloc = [&](size_t bytes) { owned.push_back(be.alloc(bytes)); return owned.back(); };
    Json out = Json::object();
    try {
        auto* x = static_cast<float*>(alloc(sizeof(float) * M_max * D));
        auto* gate_w = static_cast<float*>(alloc(sizeof(float) * n_experts * D));
        auto* gate_b = static_cast<float*>(alloc(sizeof(float) * n_experts));
        auto* logits = static_cast<float*>(alloc(sizeof(float) * M_max * n_experts));
        auto* idx = static_cast<int32_t*>(alloc(sizeof(int32_t) * M_max * top_k));
        auto* wts = static_cast<float*>(alloc(sizeof(float) * M_max * top_k));
        auto* y = static_cast<float*>(alloc(sizeof(float) * M_max * D));
        upload_random(be, x, static_cast<size_t>(M_max) * D, 1, 1.0f, false);
        upload_random(be, gate_w, static_cast<size_t>(n_experts) * D, 2, 0.02f, false);
        upload_random(be, gate_b, n_experts, 3, 0.01f, false);
        // Expert e is weight set e, the shared expert set n_experts. Throughput does not depend on the
        // values, so four random sets are made and copied round: little host time and memory.
        const int sets = n_experts + 1, unique = std::min(sets, 4);
        ExpertWeights f32, q4;
        f32.n_experts = q4.n_experts = n_experts;
        f32.dim = q4.dim = D;
        f32.inter = q4.inter = I;
        q4.int4 = true;
        f32.shared = q4.shared = true;
        float* fw[3];
        int32_t* qw[3];
        float* qs[3];
        for (int k = 0; k < 3; ++k) {
            fw[k] = static_cast<float*>(alloc(sizeof(float) * per * sets));
            upload_random(be, fw[k], per * unique, 10 + k, 0.02f, false);
            for (int s = unique; s < sets; ++s) be.copy(fw[k] + s * per, fw[k] + (s % unique) * per, sizeof(float) * per);
            qw[k] = static_cast<int32_t*>(alloc(sizeof(int32_t) * per / 8 * sets));
            upload_random(be, qw[k], per / 8 * unique, 20 + k, 0, true);
            for (int s = unique; s < sets; ++s) be.copy(qw[k] + s * per / 8, qw[k] + (s % unique) * per / 8, sizeof(int32_t) * per / 8);
            qs[k] = static_cast<float*>(alloc(sizeof(float) * per / 32 * sets));
            upload_random(be, qs[k], per / 32 * unique, 30 + k, 0.003f, false);
            for (int s = unique; s < sets; ++s) be.copy(qs[k] + s * per / 32, qs[k] + (s % unique) * per / 32, sizeof(float) * per / 32);
        }
        f32.w1 = fw[0]; f32.w2 = fw[1]; f32.w3 = fw[2];
        q4.q1 = qw[0]; q4.q2 = qw[1]; q4.q3 = qw[2];
        q4.s1 = qs[0]; q4.s2 = qs[1]; q4.s3 = qs[2];
        MoeRouting r;
        r.n_experts = n_experts;
        r.top_k = top_k;
        r.route_scale = 2.827f;

        const auto layer = [&](int M, bool int4) {
            be.matmul_f32(logits, x, gate_w, nullptr, M, n_experts, D);
            be.moe_gate_ffn(y, x, idx, wts, logits, gate_b, M, r, int4 ? q4 : f32);
        };
        struct Timed {
            std::vector<double> ms, cpu_ms, shares, probe_ms;  // every repeat's milliseconds, CPU ms, CPU share, probe CPU ms
        };
        const auto time_layer = [&](int M, bool int4) {
            layer(M, int4);  // warm-up
            be.synchronize();
            Timed t;
            for (int i = 0; i < repeats; ++i) {
                const Stopwatch run;
                double best_ms = 0, best_cpu_ms = 0;
                do {  // a repeat lasts at least --min-time-ms, its figures its best call's (Sample)
                    const Stopwatch call;
                    layer(M, int4);
                    be.synchronize();
                    const double ms = (now_seconds() - call.wall) * 1e3, cpu_ms = ms * call.share();
                    best_ms = best_ms > 0 ? std::min(best_ms, ms) : ms;
                    best_cpu_ms = best_cpu_ms > 0 ? std::min(best_cpu_ms, cpu_ms) : cpu_ms;
                } while (now_seconds() - run.wall < min_time);
                t.ms.push_back(best_ms);
                t.shares.push_back(run.share());
                t.cpu_ms.push_back(best_cpu_ms);
                t.probe_ms.push_back(probe.next() * 1e3);
            }
            return t;
        };
        const bool noisy = be.name() == "cpu";
        Json rows = Json::array();
        for (int M : token_counts) {
            const Timed f = time_layer(M, false), q = time_layer(M, true);
            const std::vector<double>& sf = f.ms;
            const std::vector<double>& sq = q.ms;
            const double tf = *std::min_element(sf.begin(), sf.end()) / 1e3, tq = *std::min_element(sq.begin(), sq.end()) / 1e3;
            std::vector<double> speedups, cpu_speedups, shares, cal_speedups;
            for (size_t i = 0; i < sf.size(); ++i) {
                speedups.push_back(sf[i] / sq[i]);
                cpu_speedups.push_back(f.cpu_ms[i] / q.cpu_ms[i]);
                shares.push_back(std::min(f.shares[i], q.shares[i]));
                if (i < f.probe_ms.size() && i < q.probe_ms.size() && q.probe_ms[i] > 0) cal_speedups.push_back(f.probe_ms[i] / q.probe_ms[i]);
            }
            const auto cpu = [&](const std::vector<double>& v) { return noisy ? v : std::vector<double>{}; };
            Json row = Json::object();
            row.set("tokens", M).set("fp32_ms", tf * 1e3).set("int4_ms", tq * 1e3).set("int4_speedup", tf / tq);
            rows.push(row);
            std::printf("  moe layer (D %d, I %d, E %d, top-%d + 1 shared) M=%2d: fp32 %9.3f ms  int4 %9.3f ms  speedup %.2fx\n",
                        D, I, n_experts, top_k, M, tf * 1e3, tq * 1e3, tf / tq);
            const std::string m = std::to_string(M);
            metrics.set("moe_layer.fp32_ms_m" + m, metric(tf * 1e3, "ms", "lower", sf, noisy, cpu(f.cpu_ms), cpu(f.shares), cpu(f.probe_ms)));
            metrics.set("moe_layer.int4_ms_m" + m, metric(tq * 1e3, "ms", "lower", sq, noisy, cpu(q.cpu_ms), cpu(q.shares), cpu(q.probe_ms)));
            metrics.set("moe_layer.int4_speedup_m" + m,
                        metric(tf / tq, "x", "higher", speedups, noisy, cpu(cpu_speedups), cpu(shares), cpu(cal_speedups)));
        }
        out.set("dim", D).set("moe_inter_dim", I).set("n_experts", n_experts).set("top_k", top_k).set("n_shared", 1);
        out.set("rows", rows);
    } catch (...) {
        for (void* p : owned) be.release(p);
        throw;
    }
    for (void* p : owned) be.release(p);
    return out;
}

// Every flag of `kdtree bench`, checked before any work starts.
struct BenchOptions {
    std::string backend, manifest, out;
    std::vector<int> budgets, moe_tokens;
    int repeats = 3, n = 0, experts = 0;  // n 0: each bundle's golden length
    double min_time = 0;                  // seconds a run lasts at least (Sample); 0: one generation
    uint64_t max_memory = kDefaultMaxMemory;
};

BenchOptions read_bench_options(const Args& a) {
    BenchOptions o;
    o.backend = backend_flag(a);
    const bool gpu = o.backend == "cuda";
    o.manifest = a.str("--manifest", "tests/refs/manifest.json");
    o.out = a.str("--out", "build/bench.json");
    o.budgets = a.int_list_or("--budgets", {4, 8, 16, 32, 64}, 1, kMaxBudget);
    o.repeats = a.integer("--repeats", 3, 1, 1000);
    o.min_time = a.integer("--min-time-ms", 0, 0, 10000) / 1e3;
    o.n = a.integer("-n", 0, 1, kMaxTokens);
    // Top-8 routing needs 8 experts; the CUDA gate takes up to 1024 (a thread each).
    o.experts = a.integer("--moe-experts", gpu ? 384 : 16, 8, 1024);
    o.moe_tokens = a.int_list_or("--moe-tokens", gpu ? std::vector<int>{1, 2, 4, 8, 16} : std::vector<int>{1, 4}, 1, 1024);
    o.max_memory = max_memory_flag(a);
    return o;
}

}  // namespace

int cmd_bench(int argc, char** argv) {
    const Args a(argc, argv, 2,
                 {"--manifest", "--out", "--budgets", "--repeats", "--min-time-ms", "--moe-experts", "--moe-tokens", "--backend", "-n", "--max-memory"}, {});
    const BenchOptions o = read_bench_options(a);
    const std::vector<ManifestEntry> entries = read_manifest(o.manifest);
    auto be = make_backend(o.backend);
    const bool gpu = be->name() == "cuda";
    Probe probe(be->name() == "cpu");

    Json metrics = Json::object();
    Json bundles = Json::object();
    std::vector<Bundle> loaded;
    loaded.reserve(entries.size());  // BundleRuns point into it
    std::vector<BundleRuns> runs;
    for (const ManifestEntry& entry : entries) {
        const std::string& name = entry.name;
        const Bundle& b = loaded.emplace_back(Bundle::load(entry.path, o.max_memory));
        const int tokens = o.n > 0 ? o.n : static_cast<int>(std::min<size_t>(entry.golden_length, kMaxTokens));
        if (b.prompt.size() + static_cast<size_t>(tokens) > static_cast<size_t>(b.config.max_seq_len))
            throw std::runtime_error(std::string(o.n > 0 ? "flag -n" : "manifest bundle " + name + " (its golden length)") + ": prompt (" +
                                     std::to_string(b.prompt.size()) + " tokens) + n (" + std::to_string(tokens) + ") exceeds max_seq_len " +
                                     std::to_string(b.config.max_seq_len) + " of bundle " + printable(b.path, 200));
        runs.push_back(BundleRuns{&b, name, tokens, {}, {}, {}, {}, {}, Json::array(), {}});
    }
    for (int round = 0; round < o.repeats; ++round)
        for (BundleRuns& r : runs) bundle_round(*be, probe, o.budgets, o.min_time, r);
    for (const BundleRuns& r : runs) {
        std::printf("bundle %s (%d tokens)\n", r.name.c_str(), r.n);
        bundles.set(r.name, bench_bundle(*be, r, o.budgets, metrics));
    }
    // FP32 vs INT4 per MoE layer on the bundles: ratio of the summed MoE-layer FFN times (the
    // least of each bundle's runs), and run by run for the samples.
    for (const auto& kv : bundles.members()) {
        const std::string& name = kv.first;
        if (name.size() < 5 || name.compare(name.size() - 5, 5, "_int4") != 0) continue;
        const std::string fp32 = name.substr(0, name.size() - 5) + "_fp32";
        if (!bundles.has(fp32)) continue;
        const auto numbers = [](const Json& j, const char* key) {
            std::vector<double> v;
            if (j.has(key))
                for (const Json& x : j.at(key).items()) v.push_back(x.as_number());
            return v;
        };
        const std::vector<double> sq = numbers(kv.second, "moe_ffn_ms"), sf = numbers(bundles.at(fp32), "moe_ffn_ms");
        const std::vector<double> cq = numbers(kv.second, "moe_ffn_cpu_ms"), cf = numbers(bundles.at(fp32), "moe_ffn_cpu_ms");
        const std::vector<double> pq = numbers(kv.second, "moe_ffn_probe_ms"), pf = numbers(bundles.at(fp32), "moe_ffn_probe_ms");
        if (sq.empty() || sf.empty()) continue;
        const double tq = *std::min_element(sq.begin(), sq.end()), tf = *std::min_element(sf.begin(), sf.end());
        std::vector<double> speedups, cpu_speedups, cal_speedups;
        for (size_t i = 0; i < std::min(sq.size(), sf.size()); ++i)
            if (sq[i] > 0) speedups.push_back(sf[i] / sq[i]);
        for (size_t i = 0; i < std::min(cq.size(), cf.size()); ++i) {
            if (!(cq[i] > 0)) continue;
            cpu_speedups.push_back(cf[i] / cq[i]);
            cal_speedups.push_back(i < pq.size() && i < pf.size() && pq[i] > 0 ? pf[i] / pq[i] : 0.0);
        }
        if (tq > 0)
            metrics.set(name + ".moe_ffn_speedup_over_fp32", metric(tf / tq, "x", "higher", speedups, !gpu, cpu_speedups, {}, cal_speedups));
    }
    std::printf("K2-width MoE layer, random weights\n");
    const Json moe = bench_moe_layer(*be, probe, o.experts, o.moe_tokens, o.repeats, o.min_time, metrics);

    Json host = Json::object();
    host.set("cpu", be->name() == "cpu" ? be->device_description() : make_cpu_backend()->device_description());
    host.set("gpu", gpu ? be->device_description() : "none");
    Json out = Json::object();
    out.set("version", 1).set("backend", be->name()).set("tree", source_tree_hash()).set("host", host);
    out.set("repeats", o.repeats).set("min_time_ms", static_cast<int>(o.min_time * 1e3 + 0.5));
    out.set("metrics", metrics).set("bundles", bundles).set("moe_layer", moe);
    if (!gpu) out.set("calibration_probe", probe.summary());
    std::ofstream f(o.out);
    if (!f || !(f << out.dump(2) << "\n")) throw std::runtime_error("cannot write " + printable(o.out));
    std::printf("wrote %s\n", o.out.c_str());
    return 0;
}

}  // namespace kd
