// fuzz.cpp: a mutation fuzzer for the engine's input readers (README.md, "Input validation"):
// KDTR bundles of format versions 1 and 2 (preamble, header JSON, config, tensor table, data
// section, version 2's trailing index), manifests, the JSON
// reader itself and the command-line flags. Each case runs in a forked child through the real
// command line (kd::cli_main) or Json::parse, with a time limit; the parent classifies the end.
// Built by `KD_SANITIZE=1 scripts/build.sh` as build/fuzz (ASan + UBSan catch what a crash
// would not show).
//
//   build/fuzz run    --refs DIR [--cases N] [--seconds S] [--seed X] [--findings DIR] [--timeout 30] [--log F]
//   build/fuzz replay --refs DIR CASE...
//
// run: mutates the seed cases (built from the bundles and manifest in DIR) until N cases or S
// seconds, and prints one summary line; every case must end with exit 0 or a named error
// (exit 1, "kdtree <cmd>: error: ..." naming the file or flag). A crash (signal), a sanitizer
// report, a timeout, a runaway allocation (an allocation over the limits below, or an
// out-of-memory) or an unnamed error is a finding: written to --findings as a case file; exit 1.
// --log writes one line per case: kind, end, the first line of its stderr.
// replay: runs committed case files (tests/fuzz/regress/); each must end as its `expect:` says.
// One line per case: "ok|FAIL <file> <seconds> <end>: <first line of its stderr>".
//
// Case file: header lines "kind: bundle|manifest|json|flags", "base: <bundle file in DIR>",
// "args: <argv after the program name, space-separated; @BUNDLE @MANIFEST @OUT substituted>",
// "data: <bytes of the base's data section to append, default all>", "expect: ok | <substring
// of the error>", "set: <path> = <raw JSON>" (bundles, repeatable: the header with the value at
// path, e.g. config.n_heads or tensors[0].shape, replaced by that text), "version: 2" (bundles:
// the base in format version 2: its header without data_sha256, and after the data the zero fill
// and the index of the base's tensor hashes with the digest of the case's own header bytes),
// "tail: stale | flip K | cut K | grow K | count K" (version 2: the digest of the base's header
// instead, or bit 0 of index byte K flipped, K bytes cut from the end, K zero bytes appended, the
// count set to K), then a line "---" and
// the body: for bundles the preamble and header, or only a header (the preamble is then made for
// it), or nothing (the base's own); the base's data section follows. For manifests and JSON the
// body is the text. In a body "@@REPEAT n@@text@@END@@" stands for text n times ('#' in it
// replaced by the repetition's index).
#include "cli.h"
#include "json.h"
#include "sha256.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

using kd::Json;

namespace {

// Each child runs under this memory limit (passed as --max-memory); anything well past it is a
// runaway allocation: ASan refuses a single allocation over kMaxAllocMb and stops a child whose
// resident memory passes kRssLimitMb (shadow memory and the quarantine included).
const char* kMaxMemory = "256M";
constexpr int kMaxAllocMb = 768;
constexpr int kRssLimitMb = 1536;

struct Rng {
    uint64_t s;
    uint64_t next() {
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    size_t below(size_t n) { return n ? static_cast<size_t>(next() % n) : 0; }
    bool chance(int percent) { return below(100) < static_cast<size_t>(percent); }
    template <class T>
    const T& pick(const std::vector<T>& v) { return v[below(v.size())]; }
};

struct Case {
    std::string kind;       // bundle | manifest | json | flags
    std::string base;       // bundle: the base bundle's file name
    std::string args;       // argv after the program name
    int64_t data = -1;      // bundle: bytes of the base's data section appended (-1: all)
    std::string expect;     // replay: "ok" or a substring of the error
    std::vector<std::string> sets;  // bundle: "<path> = <raw JSON>" applied to the header
    int version = 1;        // bundle: the format version it is written in
    std::string tail;       // bundle, version 2: how the index is spoiled (empty: not at all)
    std::string body;
};

std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + path);
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
}

void write_file(const std::string& path, const std::string& data) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out || !out.write(data.data(), static_cast<std::streamsize>(data.size()))) throw std::runtime_error("cannot write " + path);
}

Case parse_case(const std::string& text, const std::string& name) {
    Case c;
    size_t pos = 0;
    while (true) {
        const size_t nl = text.find('\n', pos);
        if (nl == std::string::npos) throw std::runtime_error(name + ": no '---' line before the body");
        const std::string line = text.substr(pos, nl - pos);
        pos = nl + 1;
        if (line == "---") break;
        const size_t colon = line.find(": ");
        if (colon == std::string::npos) throw std::runtime_error(name + ": bad header line '" + line + "'");
        const std::string key = line.substr(0, colon), value = line.substr(colon + 2);
        if (key == "kind") c.kind = value;
        else if (key == "base") c.base = value;
        else if (key == "args") c.args = value;
        else if (key == "data") c.data = std::stoll(value);
        else if (key == "expect") c.expect = value;
        else if (key == "set") c.sets.push_back(value);
        else if (key == "version") c.version = std::stoi(value);
        else if (key == "tail") c.tail = value;
        else throw std::runtime_error(name + ": unknown header line '" + line + "'");
    }
    c.body = text.substr(pos);
    return c;
}

std::string format_case(const Case& c) {
    std::string s = "kind: " + c.kind + "\n";
    if (!c.base.empty()) s += "base: " + c.base + "\n";
    if (!c.args.empty()) s += "args: " + c.args + "\n";
    if (c.data >= 0) s += "data: " + std::to_string(c.data) + "\n";
    if (!c.expect.empty()) s += "expect: " + c.expect + "\n";
    for (const std::string& set : c.sets) s += "set: " + set + "\n";
    if (c.version != 1) s += "version: " + std::to_string(c.version) + "\n";
    if (!c.tail.empty()) s += "tail: " + c.tail + "\n";
    return s + "---\n" + c.body;
}

// "@@REPEAT n@@text@@END@@" -> text n times, '#' replaced by the index.
std::string expand(const std::string& body) {
    std::string out;
    size_t pos = 0;
    while (true) {
        const size_t at = body.find("@@REPEAT ", pos);
        if (at == std::string::npos) return out + body.substr(pos);
        const size_t count_end = body.find("@@", at + 9), end = body.find("@@END@@", at);
        if (count_end == std::string::npos || end == std::string::npos) return out + body.substr(pos);
        out += body.substr(pos, at - pos);
        const long n = std::stol(body.substr(at + 9, count_end - at - 9));
        const std::string text = body.substr(count_end + 2, end - count_end - 2);
        for (long i = 0; i < n; ++i) {
            std::string t = text;
            for (size_t h = t.find('#'); h != std::string::npos; h = t.find('#', h)) {
                t.replace(h, 1, std::to_string(i));
                h += std::to_string(i).size();
            }
            out += t;
        }
        pos = end + 7;
    }
}

std::vector<std::string> split_args(const std::string& s) {
    std::vector<std::string> out;
    std::istringstream in(s);
    for (std::string w; in >> w;) out.push_back(w);
    return out;
}

// ---- the bundles a case is built on ------------------------------------------------------------

struct Base {
    std::string file;
    std::string prefix;  // preamble + header + padding, as stored
    std::string header;
    std::string data;    // the data section
    std::string v2_header;  // the header without data_sha256: what it is in format version 2
    std::string hashes;     // the tensors' sha256, in table order: version 2's index entries
};

std::string preamble_and_header(const std::string& header, int version = 1);

Base load_base(const std::string& dir, const std::string& file) {
    Base b;
    b.file = file;
    const std::string bytes = read_file(dir + "/" + file);
    if (bytes.size() < 16) throw std::runtime_error(file + ": too short for a bundle");
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[8 + i]);
    const size_t start = (16 + n + 63) / 64 * 64;
    if (start > bytes.size()) throw std::runtime_error(file + ": not a bundle");
    b.prefix = bytes.substr(0, start);
    b.header = bytes.substr(16, n);
    b.data = bytes.substr(start);
    const Json h = Json::parse(b.header);
    Json v2 = Json::object();
    for (const auto& kv : h.members())
        if (kv.first != "data_sha256") v2.set(kv.first, kv.second);
    b.v2_header = v2.dump();
    for (const Json& t : h.at("tensors").items()) {
        const kd::Digest d = kd::sha256(b.data.data() + t.at("offset").as_int(), static_cast<size_t>(t.at("nbytes").as_int()));
        b.hashes.append(reinterpret_cast<const char*>(d.data()), d.size());
    }
    return b;
}

std::string preamble_and_header(const std::string& header, int version) {
    std::string s = "KDTR";
    s += static_cast<char>(version);
    s += std::string(3, '\0');
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) s += static_cast<char>((n >> (8 * i)) & 0xFF);
    s += header;
    s.append((64 - s.size() % 64) % 64, '\0');
    return s;
}

struct Env {
    std::string refs, work;
    std::string manifest;  // small_manifest(): what a flags case's @MANIFEST holds
    std::vector<Base> bases;
    const Base& base(const std::string& file) const {
        for (const Base& b : bases)
            if (b.file == file) return b;
        throw std::runtime_error("unknown base bundle " + file);
    }
};

std::string apply_sets(const std::string& header, const std::vector<std::string>& sets);

std::string header_of(const std::string& prefix) {
    if (prefix.size() < 16) return "";
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(prefix[8 + i]);
    return prefix.substr(16, std::min<uint64_t>(n, prefix.size() - 16));
}

// Version 2's zero fill and index after the base's data: the base's tensor hashes and the digest
// of `prefix` (the case's own bytes before the data, so that a header change is not refused for
// the digest alone), then spoiled as `tail` says.
std::string v2_index(const Base& b, const std::string& prefix, const std::string& tail) {
    std::string index = "KDTI";
    const uint32_t count = static_cast<uint32_t>(b.hashes.size() / 32);
    for (int i = 0; i < 4; ++i) index += static_cast<char>((count >> (8 * i)) & 0xFF);
    index += b.hashes;
    const std::string& signed_prefix = tail == "stale" ? preamble_and_header(b.v2_header, 2) : prefix;
    kd::Sha256 digest;
    digest.update(signed_prefix.data(), signed_prefix.size());
    digest.update(index.data(), index.size());
    const kd::Digest d = digest.digest();
    index.append(reinterpret_cast<const char*>(d.data()), d.size());
    const size_t space = tail.find(' ');
    const uint64_t k = space == std::string::npos ? 0 : std::stoull(tail.substr(space + 1));
    const std::string op = tail.substr(0, space);
    if (op == "flip" && k < index.size()) index[k] ^= 1;
    else if (op == "cut") index.resize(index.size() - std::min<uint64_t>(k, index.size()));
    else if (op == "grow") index.append(std::min<uint64_t>(k, 1 << 20), '\0');
    else if (op == "count") for (int i = 0; i < 4; ++i) index[4 + i] = static_cast<char>((k >> (8 * i)) & 0xFF);
    return std::string((64 - (prefix.size() + b.data.size()) % 64) % 64, '\0') + index;
}

// Writes the case's files under env.work and returns its argv (program name first).
std::vector<std::string> materialize(const Env& env, const Case& c) {
    const std::string bundle = env.work + "/case.kdtr", manifest = env.work + "/manifest.json";
    if (c.kind == "bundle") {
        const Base& b = env.base(c.base);
        std::string bytes = c.body.empty() ? (c.version == 2 ? preamble_and_header(b.v2_header, 2) : b.prefix) : expand(c.body);
        if (bytes.rfind("KDTR", 0) != 0) bytes = preamble_and_header(bytes, c.version);
        if (!c.sets.empty()) bytes = preamble_and_header(apply_sets(header_of(bytes), c.sets), c.version);
        const std::string prefix = bytes;
        bytes += c.data < 0 ? b.data : b.data.substr(0, static_cast<size_t>(std::min<int64_t>(c.data, static_cast<int64_t>(b.data.size()))));
        if (c.version == 2) bytes += v2_index(b, prefix, c.tail);
        write_file(bundle, bytes);
    } else if (c.kind == "manifest") {
        write_file(manifest, expand(c.body));
    } else if (c.args.find("@MANIFEST") != std::string::npos) {
        write_file(manifest, env.manifest);  // never what an earlier case left: a case replays alone
    }
    std::vector<std::string> argv{"kdtree"};
    for (std::string w : split_args(c.args)) {
        if (w == "@BUNDLE") w = bundle;
        else if (w == "@MANIFEST") w = manifest;
        else if (w == "@OUT") w = env.work + "/out.json";
        else if (w.rfind("@REFS/", 0) == 0) w = env.refs + "/" + w.substr(6);
        argv.push_back(w);
    }
    return argv;
}

// ---- one case in a child -----------------------------------------------------------------------

enum class End { Ok, NamedError, UnnamedError, Crash, Sanitizer, Timeout, Runaway, WrongExpectation };
const char* end_name(End e) {
    switch (e) {
        case End::Ok: return "ok";
        case End::NamedError: return "named error";
        case End::UnnamedError: return "unnamed error";
        case End::Crash: return "crash";
        case End::Sanitizer: return "sanitizer report";
        case End::Timeout: return "timeout";
        case End::Runaway: return "runaway allocation";
        case End::WrongExpectation: return "not as expected";
    }
    return "?";
}

// The JSON target: parse; what parses must dump to text that parses to the same dump.
int json_target(const std::string& text) {
    Json v;
    try {
        v = Json::parse(text);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kdtree json: error: %s\n", e.what());
        return 1;
    }
    const std::string once = v.dump();
    if (Json::parse(once).dump() != once) {
        std::fprintf(stderr, "json round trip differs\n");
        std::abort();
    }
    return 0;
}

struct Outcome {
    End end = End::Ok;
    int code = 0;
    std::string detail;  // first lines of stderr, or the signal
};

Outcome run_case(const Env& env, const Case& c, double timeout_s) {
    const std::vector<std::string> args = materialize(env, c);
    const std::string err_path = env.work + "/stderr", out_path = env.work + "/stdout";
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
        const int out_fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        const int err_fd = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (out_fd < 0 || err_fd < 0) _exit(99);
        dup2(out_fd, 1);
        dup2(err_fd, 2);
        int rc = 0;
        if (c.kind == "json") {
            rc = json_target(expand(c.body));
        } else {
            std::vector<char*> argv;
            for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
            argv.push_back(nullptr);
            rc = kd::cli_main(static_cast<int>(args.size()), argv.data());
        }
        std::fflush(nullptr);
        std::exit(rc);  // exit, not _exit: LeakSanitizer checks at exit
    }
    int status = 0;
    const auto t0 = std::chrono::steady_clock::now();
    bool timed_out = false;
    while (waitpid(pid, &status, WNOHANG) == 0) {
        if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_s) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            timed_out = true;
            break;
        }
        usleep(500);
    }
    Outcome o;
    std::string err;
    try { err = read_file(err_path); } catch (const std::exception&) {}
    o.detail = err.substr(0, 2000);
    const auto has = [&](const char* s) { return err.find(s) != std::string::npos; };
    if (timed_out) { o.end = End::Timeout; o.detail = "killed after " + std::to_string(timeout_s) + " s"; return o; }
    if (has("allocation-size-too-big") || has("out-of-memory") || has("RSS limit") || has("out of memory") || has("bad_alloc")) {
        o.end = End::Runaway;
        return o;
    }
    if (has("Sanitizer") || has("runtime error:")) { o.end = End::Sanitizer; return o; }
    if (WIFSIGNALED(status)) {
        o.end = End::Crash;
        o.detail = std::string("signal ") + strsignal(WTERMSIG(status)) + "\n" + o.detail;
        return o;
    }
    o.code = WEXITSTATUS(status);
    if (o.code == 0) { o.end = End::Ok; return o; }
    // `check` exits 1 with a verdict on stdout when the tokens differ: a result, not an error.
    std::string out;
    try { out = read_file(out_path).substr(0, 4096); } catch (const std::exception&) {}
    if (o.code == 1 && err.empty() && (out.rfind("MISMATCH", 0) == 0 || out.rfind("LOW ACCEPTANCE", 0) == 0)) {
        o.end = End::Ok;
        return o;
    }
    // A named error: one "kdtree <cmd>: error: " line that names the input it is about.
    const bool error_line = err.rfind("kdtree ", 0) == 0 && has(": error: ");
    bool named = true;
    if (c.kind == "bundle") named = has("case.kdtr");
    else if (c.kind == "manifest") named = has("manifest.json") || has("bundle ");
    else if (c.kind == "flags") named = has("flag ") || has("--") || has("unknown argument") || has(".kdtr") || has("manifest");
    o.end = (o.code == 1 || (c.kind == "flags" && o.code == 2)) && error_line && named ? End::NamedError : End::UnnamedError;
    return o;
}

// ---- mutations ---------------------------------------------------------------------------------

const std::vector<std::string> kInts = {
    "0", "1", "-1", "2", "3", "4", "7", "8", "15", "16", "17", "31", "32", "33", "63", "64", "65", "127", "255", "256",
    "257", "399", "400", "401", "1023", "1024", "4095", "65535", "65536", "16777216", "16777217", "2147483647",
    "2147483648", "-2147483648", "4294967295", "4294967296", "4294967301", "4294967696", "9007199254740993",
    "4611686018427387904", "9223372036854775807", "9223372036854775808", "-9223372036854775808",
    "18446744073709551616", "10000000", "1073741824"};
const std::vector<std::string> kOtherNumbers = {
    "1e300", "-1e300", "1e-310", "5e-324", "1e400", "-0", "0.5", "1.5", "-0.0", "1e9", "2e9", "3.4e38", "3.5e38",
    "NaN", "Infinity", "-Infinity", "1E2", "0.000001", "1e-45", "100.0"};
const std::vector<std::string> kOtherValues = {
    "null", "true", "false", "\"\"", "\"x\"", "[]", "{}", "[1]", "[-1]", "[0,0]", "\"f32\"", "\"i32\"", "\"f16\"",
    "\"int4\"", "\"fp32\"", "\"../../../etc/passwd\"", "\"\\u0000\"", "\"\\ud800\"", "\"\\udc00x\"", "\"\\u12zz\"",
    "\"\\uzzzz\"", "\"1-2\"", "\"\xff\xfe\"", "\"\xc0\x80\"", "\"\xed\xa0\x80\"", "[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]"};
const std::vector<std::string> kSnippets = {
    "[", "]", "{", "}", ",", ":", "\"", "\\", "\\u", "\\u12zz", "\\ud800", "1-2", "-", "+1", "01", "1e", "1.", ".5",
    "\x00", "\x01", "\x7f", "\xff", "\xc3\x28", "\xe2\x82", "\xf4\x90\x80\x80", "NaN", "Infinity", "nul", "tru",
    "1e999", "9223372036854775808", "\"dim\":1,", "\"dim\":0,", "\"vocab_size\":4294967696,"};

std::string random_value(Rng& r, const std::string& current) {
    const size_t k = r.below(10);
    if (k < 5) return r.pick(kInts);
    if (k < 7) return r.pick(kOtherNumbers);
    if (k < 9) return r.pick(kOtherValues);
    // near the current value
    char* end = nullptr;
    const long long v = std::strtoll(current.c_str(), &end, 10);
    if (end && *end == '\0' && !current.empty()) {
        // In 128 bits: next to int64's ends the neighbours leave its range, which is the point.
        const __int128 x = v, deltas[] = {-1, 1, -64, 64, x, -2 * x - 1};
        __int128 y = x + deltas[r.below(6)];
        const bool negative = y < 0;
        std::string digits;
        do {
            const int d = static_cast<int>(y % 10);
            digits.insert(digits.begin(), static_cast<char>('0' + (negative ? -d : d)));
            y /= 10;
        } while (y != 0);
        return (negative ? "-" : "") + digits;
    }
    return r.pick(kInts);
}

// A path into a Json tree: object keys and array indices.
struct Step { bool key; std::string name; size_t index; };
using Path = std::vector<Step>;

void collect_paths(const Json& v, Path& at, std::vector<Path>& out) {
    out.push_back(at);
    if (v.is_object()) {
        for (const auto& kv : v.members()) {
            at.push_back({true, kv.first, 0});
            collect_paths(kv.second, at, out);
            at.pop_back();
        }
    } else if (v.is_array()) {
        // Long arrays (prompt, golden, tensors) are sampled: the first, the last, and a few between.
        const size_t n = v.items().size();
        for (size_t i = 0; i < n; i += (i < 3 || n - i <= 2) ? 1 : std::max<size_t>(n / 7, 1)) {
            at.push_back({false, "", i});
            collect_paths(v.items()[i], at, out);
            at.pop_back();
        }
    }
}

// v with the value at path replaced (replacement null: removed from its object or array).
Json replaced(const Json& v, const Path& path, size_t depth, const Json* replacement) {
    if (depth == path.size()) return replacement ? *replacement : Json();
    const Step& s = path[depth];
    if (s.key) {
        Json o = Json::object();
        for (const auto& kv : v.members()) {
            if (kv.first != s.name) o.set(kv.first, kv.second);
            else if (depth + 1 < path.size() || replacement) o.set(kv.first, replaced(kv.second, path, depth + 1, replacement));
        }
        if (!v.has(s.name) && depth + 1 == path.size() && replacement) o.set(s.name, *replacement);  // a new key
        return o;
    }
    Json a = Json::array();
    for (size_t i = 0; i < v.items().size(); ++i) {
        if (i != s.index) a.push(v.items()[i]);
        else if (depth + 1 < path.size() || replacement) a.push(replaced(v.items()[i], path, depth + 1, replacement));
    }
    return a;
}

const char* kRaw = "\x01raw\x01";

// root with the value at path replaced by the raw JSON text `raw`, as text.
std::string with_raw(const Json& root, const Path& path, const std::string& raw) {
    const Json placeholder(kRaw);
    std::string s = replaced(root, path, 0, &placeholder).dump();
    const std::string quoted = "\"\\u0001raw\\u0001\"";
    const size_t p = s.find(quoted);
    if (p != std::string::npos) s.replace(p, quoted.size(), raw);
    return s;
}

// "config.n_heads", "tensors[3].shape[0]" -> steps
Path parse_path(const std::string& text) {
    Path path;
    size_t i = 0;
    while (i < text.size()) {
        if (text[i] == '.') { ++i; continue; }
        if (text[i] == '[') {
            const size_t close = text.find(']', i);
            path.push_back({false, "", std::stoul(text.substr(i + 1, close - i - 1))});
            i = close + 1;
            continue;
        }
        const size_t end = text.find_first_of(".[", i);
        path.push_back({true, text.substr(i, end == std::string::npos ? std::string::npos : end - i), 0});
        i = end == std::string::npos ? text.size() : end;
    }
    return path;
}

std::string apply_sets(const std::string& header, const std::vector<std::string>& sets) {
    std::string text = header;
    for (const std::string& set : sets) {
        const size_t eq = set.find(" = ");
        if (eq == std::string::npos) throw std::runtime_error("bad set line '" + set + "'");
        text = with_raw(Json::parse(text), parse_path(set.substr(0, eq)), set.substr(eq + 3));
    }
    return text;
}

// The header with the value at a random path changed (a raw JSON token, removed, or a sibling key
// added), as text.
std::string mutate_tree(Rng& r, const std::string& text) {
    Json root;
    try {
        root = Json::parse(text);
    } catch (const std::exception&) {
        return "";
    }
    std::vector<Path> paths;
    Path at;
    collect_paths(root, at, paths);
    // Config fields first: their relations are where the engine trusted its input most.
    Path path = r.pick(paths);
    if (r.chance(50) && root.is_object() && root.has("config") && root.at("config").is_object() && !root.at("config").members().empty()) {
        const auto& m = root.at("config").members();
        path = {{true, "config", 0}, {true, m[r.below(m.size())].first, 0}};
    }
    const Json* current = &root;
    for (const Step& s : path) current = s.key ? &current->at(s.name) : &current->at(s.index);
    const size_t op = r.below(10);
    Json out;
    if (op == 0 && !path.empty()) {
        out = replaced(root, path, 0, nullptr);
    } else if (op == 1 && current->is_object()) {
        Json o = *current;
        o.set(r.chance(50) ? "unknown_field" : "rope_scaling", Json(1));
        out = replaced(root, path, 0, &o);
    } else {
        return with_raw(root, path, random_value(r, current->is_number() ? current->dump() : ""));
    }
    return out.dump();
}

// Byte-level changes to a text: flips, inserted snippets, deletions, repeats, deep nesting.
std::string mutate_text(Rng& r, std::string s) {
    const size_t n = 1 + r.below(3);
    for (size_t i = 0; i < n; ++i) {
        const size_t pos = r.below(s.size() + 1);
        switch (r.below(7)) {
            case 0: if (!s.empty()) s[std::min(pos, s.size() - 1)] ^= static_cast<char>(1 << r.below(8)); break;
            case 1: s.insert(pos, r.pick(kSnippets)); break;
            case 2: s.erase(pos, r.below(16)); break;
            case 3: if (pos < s.size()) s.insert(pos, s.substr(pos, r.below(64))); break;
            case 4: {  // nesting: a few levels past any limit, or a lot
                const size_t depth = r.chance(50) ? 200 + r.below(200) : 1000 + r.below(60000);
                const std::string open = r.chance(50) ? "[" : "{\"a\":";
                std::string nest;
                for (size_t d = 0; d < depth; ++d) nest += open;
                s.insert(pos, nest);
                break;
            }
            case 5: s = s.substr(0, pos); break;
            case 6: {  // many keys in one object
                std::string keys;
                const size_t k = 100 + r.below(20000);
                for (size_t j = 0; j < k; ++j) keys += "\"k" + std::to_string(j) + "\":0,";
                const size_t brace = s.find('{');
                if (brace != std::string::npos) s.insert(brace + 1, keys);
                break;
            }
        }
    }
    return s;
}

// Bases by size: the smallest (tiny2_int4, 5 MB) most often, the 19 MB tiny_fp32 least.
size_t pick_base(Rng& r) {
    const size_t k = r.below(20);
    return k < 11 ? 3 : k < 16 ? 2 : k < 19 ? 1 : 0;
}

Case mutate_bundle(Rng& r, const Env& env, Case c) {
    const Base& b = env.base(c.base);
    std::string body = c.body.empty() ? (c.version == 2 ? preamble_and_header(b.v2_header, 2) : b.prefix) : expand(c.body);
    const std::string header = header_of(body);
    const size_t op = r.below(c.version == 2 ? 22 : 20);
    if (op >= 20) {  // version 2's index
        static const char* const ops[] = {"stale", "flip", "cut", "grow", "count"};
        const std::string what = ops[r.below(5)];
        const uint64_t k = r.chance(50) ? r.below(72) : r.pick(std::vector<uint64_t>{0, 1, 4, 5, 8, 31, 32, 63, 64, uint64_t{1} << 31, ~uint32_t{0}});
        c.tail = what == "stale" ? what : what + " " + std::to_string(k);
    } else if (op < 11) {  // a header value
        const std::string m = mutate_tree(r, header);
        body = preamble_and_header(m.empty() ? mutate_text(r, header) : m, c.version);
    } else if (op < 15) {  // header bytes
        body = preamble_and_header(mutate_text(r, header), c.version);
    } else if (op < 17) {  // preamble
        body = body.size() >= 16 ? body : b.prefix;
        const size_t at = r.below(16);
        if (r.chance(50)) body[at] ^= static_cast<char>(1 << r.below(8));
        else {
            const uint64_t values[] = {0, 1, header.size() - 1, header.size() + 1, header.size() + 64, uint64_t{1} << 32,
                                       uint64_t{1} << 62, ~uint64_t{0}, b.data.size() + header.size()};
            const uint64_t v = values[r.below(9)];
            for (int i = 0; i < 8; ++i) body[8 + i] = static_cast<char>((v >> (8 * i)) & 0xFF);
        }
    } else if (op < 19) {  // data section length
        c.data = static_cast<int64_t>(r.below(b.data.size() + 1));
    } else {  // a different base: the same mutations meet another config
        c.base = env.bases[pick_base(r)].file;
        body = r.chance(50) ? (c.version == 2 ? preamble_and_header(env.base(c.base).v2_header, 2) : env.base(c.base).prefix)
                            : preamble_and_header(header, c.version);
    }
    c.body = body;
    return c;
}

Case mutate_manifest(Rng& r, Case c) {
    const std::string m = r.chance(70) ? mutate_tree(r, c.body) : "";
    c.body = m.empty() ? mutate_text(r, c.body) : m;
    return c;
}

Case mutate_json(Rng& r, Case c) {
    const std::string m = r.chance(50) ? mutate_tree(r, c.body) : "";
    c.body = m.empty() ? mutate_text(r, c.body) : m;
    return c;
}

// Flags: a command with a few flags, values from the interesting ones and mutated lists.
Case make_flags(Rng& r) {
    static const std::vector<std::string> commands = {"generate", "check", "outputs", "bench"};
    static const std::vector<std::string> flags = {"-n", "--budget", "--block", "--prompt", "--mode", "--backend",
                                                   "--expect", "--budgets", "--repeats", "--moe-experts", "--moe-tokens",
                                                   "--max-memory", "--json", "--bogus", "--out"};
    static const std::vector<std::string> extra = {"1,-5", "0", "", ",", "1,,2", "+1", "0x10", "1e3", "1,2,3", "ar", "ddtree",
                                                   "cpu", "cuda", "golden", "4G", "1T", "64M", "0M", "16E", "1GiB", "512K",
                                                   "18446744073709551615", "-", "99999999999999999999999", "1,4294967301",
                                                   "399,0,1", "-1,2"};
    Case c;
    c.kind = "flags";
    const std::string cmd = r.pick(commands);
    c.args = cmd;
    if (cmd == "generate" || cmd == "check") c.args += " --bundle @REFS/" + std::string(r.chance(50) ? "model_tiny2_int4.kdtr" : "model_tiny2_fp32.kdtr");
    else if (cmd == "outputs") c.args += " --manifest @MANIFEST --out @OUT";
    else c.args += " --manifest @OUT.missing";  // bench runs minutes once its flags pass: stop at the manifest
    if (!r.chance(10)) c.args += std::string(" --max-memory ") + kMaxMemory;
    const size_t n = 1 + r.below(4);
    for (size_t i = 0; i < n; ++i) {
        static const std::vector<std::string> run_flags = {"-n", "--budget", "--block", "--prompt", "--mode", "--backend", "--expect", "--json"};
        static const std::vector<std::string> outputs_flags = {"--budget", "--block", "--backend"};
        static const std::vector<std::string> bench_flags = {"--budgets", "--repeats", "--min-time-ms", "-n", "--moe-experts", "--moe-tokens", "--backend"};
        const std::vector<std::string>& own = cmd == "outputs" ? outputs_flags : cmd == "bench" ? bench_flags : run_flags;
        const std::string f = r.chance(85) ? r.pick(own) : r.pick(flags);
        if (f == "--max-memory" && !r.chance(20)) continue;
        if (f == "--out") { c.args += " --out @OUT"; continue; }
        c.args += " " + f;
        if (f == "--json") continue;
        std::string v = r.chance(50) ? r.pick(kInts) : r.pick(extra);
        if (r.chance(20)) v += "," + r.pick(kInts);
        if (v.empty()) v = "''";
        c.args += " " + v;
    }
    // Runs stay short: a small -n unless the case is about -n.
    if (c.args.find(" -n ") == std::string::npos && (cmd == "generate" || cmd == "check")) c.args += " -n 2";
    return c;
}

// ---- seeds -------------------------------------------------------------------------------------

std::string small_manifest(const Env& env) {
    // The real manifest's first tiny2 entry, golden cut to 3 tokens (n = 3 keeps runs short).
    const Json m = Json::parse(read_file(env.refs + "/manifest.json"));
    Json bundles = Json::array();
    for (const Json& e : m.at("bundles").items()) {
        if (e.at("file").as_string().find("tiny2") == std::string::npos) continue;
        Json entry = Json::object();
        entry.set("name", e.at("name")).set("file", e.at("file"));
        std::vector<int32_t> golden;
        for (size_t i = 0; i < 3; ++i) golden.push_back(static_cast<int32_t>(e.at("golden").at(i).as_int()));
        entry.set("golden", Json::array_of(golden));
        bundles.push(entry);
        break;
    }
    Json out = Json::object();
    out.set("version", 1).set("bundles", bundles);
    return out.dump();
}

std::vector<Case> seeds(const Env& env) {
    std::vector<Case> out;
    for (const Base& b : env.bases) {
        Case c;
        c.kind = "bundle";
        c.base = b.file;
        c.args = std::string("generate --bundle @BUNDLE -n 2 --max-memory ") + kMaxMemory;
        c.body = b.prefix;
        out.push_back(c);
        c.args += " --mode ddtree --budget 4";
        out.push_back(c);
    }
    Case m;
    m.kind = "manifest";
    m.args = std::string("outputs --manifest @MANIFEST --out @OUT --budget 4 --max-memory ") + kMaxMemory;
    m.body = env.manifest;
    out.push_back(m);
    Case j;
    j.kind = "json";
    j.body = env.bases.front().header;
    out.push_back(j);
    j.body = m.body;
    out.push_back(j);
    j.body = "{\"a\":[1,-2.5e-3,\"\\u00e9\\ud83d\\ude00\",true,false,null,{}],\"b\":\"\xc3\xa9\"}";
    out.push_back(j);
    return out;
}

// ---- modes -------------------------------------------------------------------------------------

struct Options {
    std::string refs = "tests/refs", findings = "build/fuzz_findings", log;
    long cases = 1000;
    double seconds = 0, timeout = 30;
    uint64_t seed = 1;
    std::vector<std::string> files;
};

Env make_env(const Options& o) {
    Env env;
    env.refs = o.refs;
    // Every case writes its bundle (5 to 19 MB): a TMPDIR on tmpfs (/dev/shm) keeps that off the disk.
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/kdfuzz.XXXXXX";
    const char* dir = mkdtemp(&tmpl[0]);
    if (!dir) throw std::runtime_error("mkdtemp failed");
    env.work = dir;
    // The manifest cases name bundles next to the manifest: link them into the work folder.
    for (const char* f : {"model_tiny_fp32.kdtr", "model_tiny_int4.kdtr", "model_tiny2_fp32.kdtr", "model_tiny2_int4.kdtr"}) {
        env.bases.push_back(load_base(o.refs, f));
        const std::string target = o.refs + "/" + f;
        char* abs = realpath(target.c_str(), nullptr);
        if (!abs || symlink(abs, (env.work + "/" + f).c_str()) != 0) throw std::runtime_error("cannot link " + target);
        free(abs);
    }
    env.manifest = small_manifest(env);
    return env;
}

void clean_env(const Env& env) {
    for (const char* f : {"case.kdtr", "manifest.json", "out.json", "stderr", "stdout", "model_tiny_fp32.kdtr", "model_tiny_int4.kdtr",
                          "model_tiny2_fp32.kdtr", "model_tiny2_int4.kdtr"})
        unlink((env.work + "/" + f).c_str());
    rmdir(env.work.c_str());
}

int cmd_run(const Options& o) {
    Env env = make_env(o);
    Rng r{o.seed};
    const std::vector<Case> seed_cases = seeds(env);
    std::vector<Case> pool = seed_cases;  // cases that ran to the end (exit 0): worth mutating further
    long counts[8] = {0};
    long n = 0, findings = 0;
    mkdir(o.findings.c_str(), 0755);
    FILE* log = o.log.empty() ? nullptr : std::fopen(o.log.c_str(), "w");
    const auto t0 = std::chrono::steady_clock::now();
    const auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
    while (n < o.cases && (o.seconds <= 0 || elapsed() < o.seconds)) {
        Case c;
        const size_t pick = r.below(100);
        if (pick < 12) c = make_flags(r);
        else {
            const bool from_seed = r.chance(70);
            c = r.pick(from_seed ? seed_cases : pool);
            if (from_seed && c.kind == "bundle") {  // the small bases most often, a third of them in version 2
                c = seed_cases[2 * pick_base(r) + r.below(2)];
                if (r.chance(33)) {
                    c.version = 2;
                    c.body.clear();
                }
            }
            if (c.kind == "flags") c = make_flags(r);
            const size_t rounds = 1 + r.below(3);
            for (size_t k = 0; k < rounds; ++k) {
                if (c.kind == "bundle") c = mutate_bundle(r, env, c);
                else if (c.kind == "manifest") c = mutate_manifest(r, c);
                else c = mutate_json(r, c);
            }
        }
        const Outcome out = run_case(env, c, o.timeout);
        if (log) std::fprintf(log, "%s\t%s\t%s\n", c.kind.c_str(), end_name(out.end), out.detail.substr(0, out.detail.find('\n')).c_str());
        ++n;
        ++counts[static_cast<int>(out.end)];
        if (out.end == End::Ok && pool.size() < 512 && c.kind != "flags") pool.push_back(c);
        if (out.end != End::Ok && out.end != End::NamedError) {
            ++findings;
            if (findings <= 50) {
                const std::string path = o.findings + "/" + std::to_string(n) + ".case";
                write_file(path, format_case(c));
                write_file(path + ".stderr", out.detail);
                std::printf("finding %ld: %s (%s case): %s\n  %s\n", findings, end_name(out.end), c.kind.c_str(), path.c_str(),
                            out.detail.substr(0, out.detail.find('\n')).c_str());
            }
        }
        if (n % 1000 == 0) {
            std::printf("  %ld cases, %.0f s, %ld findings\n", n, elapsed(), findings);
            std::fflush(stdout);
        }
    }
    clean_env(env);
    if (log) std::fclose(log);
    std::printf("fuzz: %ld cases in %.1f s (seed %llu): %ld ran to the end, %ld named errors; %ld crashes, %ld sanitizer reports, "
                "%ld timeouts, %ld runaway allocations, %ld unnamed errors\n",
                n, elapsed(), static_cast<unsigned long long>(o.seed), counts[0], counts[1], counts[3], counts[4], counts[5],
                counts[6], counts[2]);
    return findings ? 1 : 0;
}

int cmd_replay(const Options& o) {
    Env env = make_env(o);
    int failed = 0;
    for (const std::string& file : o.files) {
        const Case c = parse_case(read_file(file), file);
        const auto t0 = std::chrono::steady_clock::now();
        Outcome out = run_case(env, c, o.timeout);
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (out.end == End::Ok || out.end == End::NamedError) {
            const bool want_ok = c.expect == "ok";
            const bool as_expected = want_ok ? out.end == End::Ok : out.end == End::NamedError && out.detail.find(c.expect) != std::string::npos;
            if (!as_expected) out.end = End::WrongExpectation;
        }
        const bool ok = out.end == End::Ok || out.end == End::NamedError;
        const std::string first = out.detail.substr(0, out.detail.find('\n'));
        std::printf("%s %s %.3f %s%s%s\n", ok ? "ok" : "FAIL", file.c_str(), seconds, end_name(out.end), first.empty() ? "" : ": ",
                    first.c_str());
        if (!ok) {
            ++failed;
            if (out.end == End::WrongExpectation) std::printf("  expected: %s\n", c.expect.c_str());
        }
    }
    clean_env(env);
    std::printf("replay: %zu cases, %d not as expected\n", o.files.size(), failed);
    return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2 || (std::string(argv[1]) != "run" && std::string(argv[1]) != "replay")) {
        std::fprintf(stderr, "usage: fuzz run --refs DIR [--cases N] [--seconds S] [--seed X] [--findings DIR] [--timeout S] [--log F]\n"
                             "       fuzz replay --refs DIR CASE...\n");
        return 2;
    }
    // The children's limits: ASan stops any allocation over kMaxAllocMb and any child over kRssLimitMb.
    const std::string asan = "exitcode=86:abort_on_error=0:allocator_may_return_null=0:max_allocation_size_mb=" +
                             std::to_string(kMaxAllocMb) + ":hard_rss_limit_mb=" + std::to_string(kRssLimitMb) +
                             ":quarantine_size_mb=32:detect_leaks=1";
    // Options already in the environment come last, so they win (e.g. protect_shadow_gap=0 for CUDA).
    const auto with_env = [](std::string ours, const char* name) {
        const char* env = std::getenv(name);
        if (env && *env) ours += std::string(":") + env;
        setenv(name, ours.c_str(), 1);
    };
    with_env(asan, "ASAN_OPTIONS");
    with_env("halt_on_error=1:exitcode=87:print_stacktrace=1", "UBSAN_OPTIONS");
    try {
        Options o;
        for (int i = 2; i < argc; ++i) {
            const std::string a = argv[i];
            const auto value = [&]() -> std::string {
                if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
                return argv[++i];
            };
            if (a == "--refs") o.refs = value();
            else if (a == "--cases") o.cases = std::stol(value());
            else if (a == "--seconds") o.seconds = std::stod(value());
            else if (a == "--seed") o.seed = std::stoull(value());
            else if (a == "--findings") o.findings = value();
            else if (a == "--log") o.log = value();
            else if (a == "--timeout") o.timeout = std::stod(value());
            else if (a.rfind("--", 0) == 0) throw std::runtime_error("unknown flag " + a);
            else o.files.push_back(a);
        }
        return std::string(argv[1]) == "run" ? cmd_run(o) : cmd_replay(o);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "fuzz: error: %s\n", e.what());
        return 2;
    }
}
