// cli_generate.cpp: `kdtree generate`, `kdtree check` and `kdtree outputs`.
#include "args.h"
#include "backend.h"
#include "bundle.h"
#include "cli.h"
#include "decode.h"
#include "json.h"
#include "manifest.h"
#include "version.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace kd {
namespace {

const std::set<std::string> kRunFlags = {"--bundle", "--mode", "-n", "--prompt", "--budget", "--block", "--backend", "--max-memory"};

struct RunRequest {
    std::string mode = "ar";
    int n = 32;
    int budget = 16;
    int block = 0;  // 0: the bundle's drafter block
    std::vector<int32_t> prompt;
};

// The tree flags shared by generate, check and outputs, checked against the bundle.
void read_tree_flags(const Args& a, const Bundle& b, RunRequest& r) {
    r.budget = a.integer("--budget", 16, 1, kMaxBudget);
    r.block = a.integer("--block", b.drafter_block, 1, b.drafter_block);
}

RunRequest read_request(const Args& a, const Bundle& b) {
    RunRequest r;
    r.mode = a.str("--mode", "ar");
    if (r.mode != "ar" && r.mode != "ddtree") throw std::runtime_error("--mode must be ar or ddtree, got '" + printable(r.mode) + "'");
    r.n = a.integer("-n", 32, 1, kMaxTokens);
    read_tree_flags(a, b, r);
    if (a.has("--prompt")) {
        r.prompt = Args::int_list(a.str("--prompt", ""), "--prompt", 0, INT32_MAX);
        b.check_tokens(r.prompt, "flag --prompt");
    } else {
        r.prompt = b.prompt;
    }
    return r;
}

// What set a request's length, for check_length's message.
std::string length_source(const Args& a) { return a.has("-n") || !a.has("--prompt") ? "flag -n" : "flag --prompt"; }

// The prompt and n must fit the bundle's KV cache; `what` names what set the length.
void check_length(const Bundle& b, const RunRequest& r, const std::string& what) {
    if (r.prompt.size() + static_cast<size_t>(r.n) > static_cast<size_t>(b.config.max_seq_len))
        throw std::runtime_error(what + ": prompt (" + std::to_string(r.prompt.size()) + " tokens) + n (" + std::to_string(r.n) +
                                 ") exceeds max_seq_len " + std::to_string(b.config.max_seq_len) + " of bundle " + printable(b.path, 200));
}

Bundle load_bundle(const Args& a) {
    if (!a.has("--bundle")) throw std::runtime_error("--bundle is required");
    return Bundle::load(a.str("--bundle", ""), max_memory_flag(a));
}

Generation run(Backend& be, const Bundle& b, const RunRequest& r) {
    const bool tree = r.mode == "ddtree";
    Model model(b, be, tree ? batch_rows_needed(r.prompt.size(), r.budget) : static_cast<int>(r.prompt.size()));
    return tree ? generate_ddtree(model, r.prompt, r.n, r.budget, r.block) : generate_ar(model, r.prompt, r.n);
}

std::string token_text(const std::vector<int32_t>& tokens) {
    std::string s;
    for (size_t i = 0; i < tokens.size(); ++i) s += (i ? "," : "") + std::to_string(tokens[i]);
    return s;
}

void write_file(const std::string& path, const std::string& text) {
    std::ofstream out(path);
    if (!out) throw std::runtime_error("cannot write " + path);
    out << text;
    if (!out) throw std::runtime_error("failed writing " + path);
}

}  // namespace

int cmd_generate(int argc, char** argv) {
    std::set<std::string> valued = kRunFlags;
    const Args a(argc, argv, 2, valued, {"--json"});
    const Bundle b = load_bundle(a);
    const RunRequest r = read_request(a, b);
    check_length(b, r, length_source(a));
    auto be = make_backend(backend_flag(a));
    const Generation g = run(*be, b, r);
    if (a.has("--json")) {
        Json j = Json::object();
        j.set("bundle", b.path).set("mode", r.mode).set("backend", be->name()).set("n", r.n);
        j.set("prompt", Json::array_of(r.prompt)).set("tokens", Json::array_of(g.tokens));
        j.set("prefill_seconds", g.prefill_seconds).set("decode_seconds", g.decode_seconds);
        j.set("tokens_per_second", g.tokens_per_second()).set("forwards", g.forwards);
        if (r.mode == "ddtree") {
            j.set("budget", r.budget).set("block", r.block).set("accept_mean", g.accept_mean());
            j.set("accepted", Json::array_of(g.accepted));
        }
        std::printf("%s\n", j.dump(2).c_str());
    } else {
        std::printf("tokens: %s\n", token_text(g.tokens).c_str());
        std::printf("mode=%s backend=%s n=%d prefill_ms=%.3f decode_ms=%.3f tokens_per_s=%.1f forwards=%d", r.mode.c_str(),
                    be->name().c_str(), r.n, g.prefill_seconds * 1e3, g.decode_seconds * 1e3, g.tokens_per_second(), g.forwards);
        if (r.mode == "ddtree")
            std::printf(" budget=%d block=%d rounds=%zu accept_mean=%.3f", r.budget, r.block, g.accepted.size(), g.accept_mean());
        std::printf("\n");
    }
    return 0;
}

// Compares a generation with the bundle's golden tokens, with AR output, or with a given list.
// Exit 0 on a match (and, for ddtree with a fitted linear drafter, a mean acceptance above 1), 1
// otherwise. A lowrank_head drafter is made at random by the generator, not fitted (the big
// configs): its acceptance is reported, not judged; DDTree == AR is what its check asks.
int cmd_check(int argc, char** argv) {
    std::set<std::string> valued = kRunFlags;
    valued.insert("--expect");
    const Args a(argc, argv, 2, valued, {});
    const Bundle b = load_bundle(a);
    RunRequest r = read_request(a, b);
    auto be = make_backend(backend_flag(a));
    const std::string expect = a.str("--expect", "golden");
    std::vector<int32_t> expected;
    if (expect == "golden") {
        expected = b.golden();
        if (expected.empty()) throw std::runtime_error("bundle " + b.path + " has no golden tokens");
        r.prompt = b.prompt;
        r.n = static_cast<int>(expected.size());
    } else if (expect == "ar") {
        check_length(b, r, length_source(a));
        RunRequest ar = r;
        ar.mode = "ar";
        expected = run(*be, b, ar).tokens;
    } else {
        expected = Args::int_list(expect, "--expect", 0, INT32_MAX);
        r.n = static_cast<int>(std::min<size_t>(expected.size(), kMaxTokens));
        check_length(b, r, "flag --expect");
    }
    const Generation g = run(*be, b, r);
    std::string detail = "mode=" + r.mode + " n=" + std::to_string(r.n);
    if (r.mode == "ddtree") {
        std::ostringstream s;
        s.precision(3);
        s << std::fixed << " budget=" << r.budget << " block=" << r.block << " accept_mean=" << g.accept_mean();
        detail += s.str();
    }
    for (size_t i = 0; i < expected.size(); ++i) {
        if (g.tokens[i] != expected[i]) {
            std::printf("MISMATCH %s against %s: first difference at token %zu: expected %d, got %d\n  expected %s\n  got      %s\n",
                        detail.c_str(), expect == "golden" || expect == "ar" ? expect.c_str() : "the given tokens", i,
                        expected[i], g.tokens[i], token_text(expected).c_str(), token_text(g.tokens).c_str());
            return 1;
        }
    }
    if (r.mode == "ddtree" && b.drafter_kind == "linear" && !(g.accept_mean() > 1.0)) {
        std::printf("LOW ACCEPTANCE %s: mean acceptance length is not above 1\n", detail.c_str());
        return 1;
    }
    std::printf("ok %s\n", detail.c_str());
    return 0;
}

// Runs every bundle of a manifest in AR and DDTree mode (n = the golden length, never the
// golden tokens themselves) and writes the README's build/outputs.json.
int cmd_outputs(int argc, char** argv) {
    const Args a(argc, argv, 2, {"--manifest", "--out", "--budget", "--block", "--backend", "--max-memory"}, {});
    const uint64_t max_memory = max_memory_flag(a);
    const std::vector<ManifestEntry> entries = read_manifest(a.str("--manifest", "tests/refs/manifest.json"));
    auto be = make_backend(backend_flag(a));
    Json bundles = Json::object();
    for (const ManifestEntry& entry : entries) {
        const std::string& name = entry.name;
        const Bundle b = Bundle::load(entry.path, max_memory);
        RunRequest r;
        r.prompt = b.prompt;
        r.n = static_cast<int>(std::min<size_t>(entry.golden_length, kMaxTokens));
        check_length(b, r, "manifest bundle " + name + " (its golden length)");
        read_tree_flags(a, b, r);
        const Generation ar = run(*be, b, r);
        r.mode = "ddtree";
        const Generation tree = run(*be, b, r);
        Json o = Json::object();
        o.set("ar", Json::array_of(ar.tokens)).set("ddtree", Json::array_of(tree.tokens));
        o.set("budget", r.budget).set("block", r.block).set("accept_mean", tree.accept_mean());
        o.set("ar_tokens_per_second", ar.tokens_per_second()).set("ddtree_tokens_per_second", tree.tokens_per_second());
        bundles.set(name, o);
        std::printf("%s: ar %zu tokens, ddtree %s (budget %d, block %d, accept_mean %.3f)\n", name.c_str(), ar.tokens.size(),
                    ar.tokens == tree.tokens ? "equal" : "DIFFERENT", r.budget, r.block, tree.accept_mean());
    }
    Json out = Json::object();
    out.set("version", 1).set("tree", source_tree_hash()).set("backend", be->name()).set("bundles", bundles);
    const std::string out_path = a.str("--out", "build/outputs.json");
    write_file(out_path, out.dump(2) + "\n");
    std::printf("wrote %s\n", out_path.c_str());
    return 0;
}

}  // namespace kd
