// bundle.cpp: KDTR reader. Everything in a bundle is checked before the engine allocates for it
// (docs/engine/scripts.md, "Input validation"); every failure names the file and what is wrong with it.
#include "bundle.h"
#include "checked.h"
#include "parallel.h"
#include "tensor_set.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <new>
#include <stdexcept>

namespace kd {
namespace {

constexpr uint64_t kMaxHeaderBytes = uint64_t{256} << 20;
constexpr size_t kMaxTensors = size_t{1} << 22;
constexpr size_t kMaxRank = 8;
constexpr size_t kMaxNameBytes = 1024;

std::string shape_text(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

uint64_t read_le(const uint8_t* p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

// The member `key` of object j; throws "<where>.<key>: missing" / "expected an object".
const Json& member(const Json& j, const std::string& where, const char* key) {
    if (!j.is_object()) throw std::runtime_error(where + ": expected an object, got " + j.type_name());
    const Json* v = j.find(key);
    if (!v) throw std::runtime_error(where + "." + key + ": missing");
    return *v;
}

int64_t int_in(const Json& v, const std::string& what, int64_t lo, int64_t hi) {
    if (!v.is_integer())
        throw std::runtime_error(what + ": expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                                 describe(v));
    const int64_t x = v.as_int();
    if (x < lo || x > hi)
        throw std::runtime_error(what + ": " + std::to_string(x) + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return x;
}

const std::string& string_of(const Json& v, const std::string& what) {
    if (!v.is_string()) throw std::runtime_error(what + ": expected a string, got " + v.type_name());
    return v.as_string();
}

// A token list: an array of integers in [0, vocab) with at most max_len entries.
std::vector<int32_t> read_tokens(const Json& v, const std::string& what, int vocab, size_t max_len) {
    if (!v.is_array()) throw std::runtime_error(what + ": expected an array of token ids, got " + v.type_name());
    if (v.items().size() > max_len)
        throw std::runtime_error(what + ": " + std::to_string(v.items().size()) + " tokens, more than the " + std::to_string(max_len) +
                                 " max_seq_len allows");
    std::vector<int32_t> out;
    out.reserve(v.items().size());
    for (size_t i = 0; i < v.items().size(); ++i) {
        const Json& t = v.items()[i];
        if (!t.is_integer() || t.as_int() < 0 || t.as_int() >= vocab)
            throw std::runtime_error(what + "[" + std::to_string(i) + "] = " + describe(t) +
                                     " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
        out.push_back(static_cast<int32_t>(t.as_int()));
    }
    return out;
}

// One entry of the tensor table, checked against the data section [0, data_len).
TensorView read_tensor(const Json& t, size_t i, const uint8_t* data, uint64_t data_len) {
    const std::string where = "tensors[" + std::to_string(i) + "]";
    TensorView v;
    v.name = string_of(member(t, where, "name"), where + ".name");
    if (v.name.empty() || v.name.size() > kMaxNameBytes)
        throw std::runtime_error(where + ".name: must be 1 to " + std::to_string(kMaxNameBytes) + " bytes");
    const std::string tw = "tensor " + printable(v.name);
    v.dtype = string_of(member(t, where, "dtype"), tw + ": dtype");
    if (v.dtype != "f32" && v.dtype != "i32") throw std::runtime_error(tw + ": unknown dtype '" + printable(v.dtype) + "'");
    const Json& shape = member(t, where, "shape");
    if (!shape.is_array() || shape.items().size() > kMaxRank)
        throw std::runtime_error(tw + ": shape must be an array of at most " + std::to_string(kMaxRank) + " dimensions");
    uint64_t count = 1;
    for (const Json& d : shape.items()) {
        v.shape.push_back(int_in(d, tw + ": shape", 0, INT64_MAX));
        count = checked_mul(count, static_cast<uint64_t>(v.shape.back()), tw + ": element count of shape " + shape_text(v.shape));
    }
    const uint64_t nbytes = static_cast<uint64_t>(int_in(member(t, where, "nbytes"), tw + ": nbytes", 0, INT64_MAX));
    if (nbytes != checked_mul(count, 4, tw + ": bytes of shape " + shape_text(v.shape)))
        throw std::runtime_error(tw + ": nbytes " + std::to_string(nbytes) + " does not match shape " + shape_text(v.shape));
    const uint64_t offset = static_cast<uint64_t>(int_in(member(t, where, "offset"), tw + ": offset", 0, INT64_MAX));
    if (offset % 64 != 0) throw std::runtime_error(tw + ": offset " + std::to_string(offset) + " is not a multiple of 64");
    if (offset > data_len || nbytes > data_len - offset)
        throw std::runtime_error(tw + " out of bounds: bytes [" + std::to_string(offset) + ", " + std::to_string(offset) + " + " +
                                 std::to_string(nbytes) + ") of the data section run past its end (" + std::to_string(data_len) + " bytes)");
    v.nbytes = static_cast<size_t>(nbytes);
    v.data = data + offset;
    for (const auto& kv : t.members())
        if (kv.first != "name" && kv.first != "dtype" && kv.first != "shape" && kv.first != "offset" && kv.first != "nbytes")
            throw std::runtime_error(tw + ": unknown key '" + printable(kv.first) + "' in its table entry");
    return v;
}

// The header's top-level keys: each of the version's present (in this order, so the first
// missing one is named), no other.
void check_keys(const Json& h, int version) {
    static const char* const kKeys[] = {"quant", "config", "drafter", "prompt", "golden", "tensors", "data_bytes", "data_sha256"};
    const size_t n = version == 1 ? 8 : 7;  // version 2 has no data_sha256: its hashes are in the index
    for (size_t i = 0; i < n; ++i) member(h, "header", kKeys[i]);
    for (const auto& kv : h.members())
        if (std::find_if(kKeys, kKeys + n, [&](const char* k) { return kv.first == k; }) == kKeys + n)
            throw std::runtime_error("unknown top-level key '" + printable(kv.first) + "' (a version " + std::to_string(version) +
                                     " header has only " + std::string(version == 1 ? "config, quant, drafter, prompt, golden, tensors, data_bytes, data_sha256"
                                                                                    : "config, quant, drafter, prompt, golden, tensors, data_bytes") + ")");
}

// Every key of object j is one of `known`; throws "<where>: unknown key 'k'".
void only_keys(const Json& j, const std::string& where, std::initializer_list<const char*> known) {
    for (const auto& kv : j.members())
        if (std::find_if(known.begin(), known.end(), [&](const char* k) { return kv.first == k; }) == known.end())
            throw std::runtime_error(where + ": unknown key '" + printable(kv.first) + "'");
}

// `quant`: {"type": "fp32"} | {"type": "int4", "group_size": 32, "keep_fp32": ["dense", "shared"]}.
void read_quant(const Json& quant, Bundle& b) {
    const std::string& type = string_of(member(quant, "quant", "type"), "quant.type");
    if (type != "fp32" && type != "int4") throw std::runtime_error("quant.type: unknown quant type '" + printable(type) + "'");
    b.int4 = type == "int4";
    if (!b.int4) return only_keys(quant, "quant (fp32)", {"type"});
    only_keys(quant, "quant", {"type", "group_size", "keep_fp32"});
    if (quant.has("group_size")) int_in(quant.at("group_size"), "quant.group_size", 32, 32);
    const Json* keep = quant.find("keep_fp32");
    if (!keep) return;
    if (!keep->is_array()) throw std::runtime_error(std::string("quant.keep_fp32: expected an array of weight classes, got ") + keep->type_name());
    for (const Json& k : keep->items()) {
        const std::string& name = string_of(k, "quant.keep_fp32[]");
        bool& flag = name == "dense" ? b.keep_fp32_dense : b.keep_fp32_shared;
        if (name != "dense" && name != "shared")
            throw std::runtime_error("quant.keep_fp32: unknown weight class '" + printable(name) + "' (known: dense, shared)");
        if (flag) throw std::runtime_error("quant.keep_fp32: '" + name + "' listed twice");
        flag = true;
    }
}

// `drafter`: {"block_size": L, "mask_token": m} plus "kind": "linear" (the default) or
// "lowrank_head" with "rank": r in [1, 2 dim].
void read_drafter(const Json& drafter, Bundle& b) {
    const ModelConfig& c = b.config;
    b.drafter_block = static_cast<int>(int_in(member(drafter, "drafter", "block_size"), "drafter.block_size", 1, 256));
    checked_int_mul(b.drafter_block, c.vocab_size, "drafter.block_size x config.vocab_size");
    b.mask_token = static_cast<int>(int_in(member(drafter, "drafter", "mask_token"), "drafter.mask_token", 0, c.vocab_size - 1));
    if (const Json* kind = drafter.find("kind")) b.drafter_kind = string_of(*kind, "drafter.kind");
    if (b.drafter_kind == "linear") return only_keys(drafter, "drafter (linear)", {"block_size", "mask_token", "kind"});
    if (b.drafter_kind != "lowrank_head")
        throw std::runtime_error("drafter.kind: unknown drafter kind '" + printable(b.drafter_kind) + "' (known: linear, lowrank_head)");
    only_keys(drafter, "drafter (lowrank_head)", {"block_size", "mask_token", "kind", "rank"});
    b.drafter_rank = static_cast<int>(int_in(member(drafter, "drafter", "rank"), "drafter.rank", 1, 2 * int64_t{c.dim}));
}

// The table holds exactly the tensors the header calls for (tensor_set.h), each with its dtype
// and shape. The walk stops at the first one missing, so it ends within the table's size.
void check_tensor_set(const Bundle& b) {
    size_t found = 0;
    for_each_tensor(b, [&](const std::string& name, const char* dtype, const std::vector<int64_t>& shape) {
        const auto it = b.by_name.find(name);
        if (it == b.by_name.end())
            throw std::runtime_error("missing tensor " + name + " (the config calls for " + dtype + " " + shape_text(shape) + ")");
        const TensorView& t = b.tensors[it->second];
        if (t.dtype != dtype || t.shape != shape)
            throw std::runtime_error("tensor " + name + " is " + t.dtype + " " + shape_text(t.shape) + ", the config calls for " + dtype + " " +
                                     shape_text(shape));
        ++found;
        return true;
    });
    if (found == b.tensors.size()) return;
    std::vector<bool> wanted(b.tensors.size(), false);
    for_each_tensor(b, [&](const std::string& name, const char*, const std::vector<int64_t>&) {
        wanted[b.by_name.at(name)] = true;
        return true;
    });
    for (size_t i = 0; i < wanted.size(); ++i)
        if (!wanted[i]) throw std::runtime_error("extra tensor " + printable(b.tensors[i].name) + ": not in the config's tensor set");
}

// The index of the first of n floats at p that is not finite, or n.
size_t first_non_finite(const uint8_t* p, size_t n) {
    constexpr size_t kBlock = 4096;
    for (size_t start = 0; start < n; start += kBlock) {
        const size_t end = std::min(n, start + kBlock);
        uint32_t bad = 0;
        for (size_t k = start; k < end; ++k) {
            uint32_t u;
            std::memcpy(&u, p + 4 * k, 4);
            bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
        }
        if (!bad) continue;
        for (size_t k = start; k < end; ++k) {
            float x;
            std::memcpy(&x, p + 4 * k, 4);
            if (!std::isfinite(x)) return k;
        }
    }
    return n;
}

// Runs check(i) for every tensor on up to hardware_concurrency threads, the largest tensors
// first (one tensor's hash is sequential); throws the first failure in table order.
void check_in_parallel(const std::vector<TensorView>& ts, const std::function<std::string(size_t)>& check) {
    std::vector<size_t> order(ts.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ts[a].nbytes > ts[b].nbytes; });
    run_in_parallel(order, check);
}

// The checks of one tensor: its sha256 against want (when given), every f32 element finite.
std::string check_tensor(const TensorView& t, const uint8_t* want) {
    const uint8_t* p = static_cast<const uint8_t*>(t.data);
    if (want) {
        const Digest got = sha256(p, t.nbytes);
        Digest stored;
        std::memcpy(stored.data(), want, stored.size());
        if (got != stored)
            return "tensor " + printable(t.name) + ": sha256 " + hex(got).substr(0, 16) + "... differs from the index's " +
                   hex(stored).substr(0, 16) + "...";
    }
    if (t.dtype == "f32") {
        const size_t bad = first_non_finite(p, t.nbytes / 4);
        if (bad < t.nbytes / 4) return "tensor " + printable(t.name) + ": element " + std::to_string(bad) + " is not finite";
    }
    return "";
}

bool all_zero(const uint8_t* p, uint64_t n) {
    for (uint64_t i = 0; i < n; ++i)
        if (p[i]) return false;
    return true;
}

}  // namespace

FileBytes Bundle::read_bytes(const std::string& path, uint64_t max_memory, size_t* threads) {
    const std::string name = "bundle " + printable(path, 200);
    try {
        const InputFile in(path);
        if (in.size() > max_memory)
            throw std::runtime_error("the file is " + std::to_string(in.size()) + " bytes, over --max-memory " + std::to_string(max_memory));
        return in.read_all(threads);
    } catch (const std::bad_alloc&) {
        throw;  // the CLI's "out of memory"
    } catch (const std::exception& e) {
        throw std::runtime_error(name + ": " + e.what());
    }
}

Bundle Bundle::load(const std::string& path, uint64_t max_memory) {
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    size_t threads = 0;
    FileBytes bytes = read_bytes(path, max_memory, &threads);
    const double read_seconds = std::chrono::duration<double>(clock::now() - t0).count();
    Bundle b = from_bytes(path, std::move(bytes), max_memory);
    b.read_seconds = read_seconds;
    b.read_threads = threads;
    return b;
}

Bundle Bundle::from_bytes(const std::string& path, FileBytes bytes, uint64_t max_memory) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto fail = [&](const std::string& what) -> std::runtime_error {
        return std::runtime_error("bundle " + printable(path, 200) + ": " + what);
    };
    Bundle b;
    b.path = path;
    b.max_memory = max_memory;
    b.bytes = std::move(bytes);
    const uint8_t* const file = b.bytes.data();
    const uint64_t file_len = b.bytes.size();
    if (file_len < 16) throw fail("truncated: " + std::to_string(file_len) + " bytes, shorter than the 16-byte preamble");
    if (std::memcmp(file, "KDTR", 4) != 0) throw fail("bad magic (expected 'KDTR'): not a KDTR bundle");
    const uint64_t version = read_le(file + 4, 4);
    if (version != 1 && version != 2) throw fail("unsupported version " + std::to_string(version) + " (this engine reads versions 1 and 2)");
    b.version = static_cast<int>(version);
    const uint64_t header_len = read_le(file + 8, 8);
    if (header_len > file_len - 16)
        throw fail("truncated: header length " + std::to_string(header_len) + " runs past the end of the file (" +
                   std::to_string(file_len) + " bytes)");
    if (header_len > kMaxHeaderBytes)
        throw fail("header length " + std::to_string(header_len) + " is over the limit of " + std::to_string(kMaxHeaderBytes));
    try {
        JsonLimits limits;
        limits.max_bytes = static_cast<size_t>(std::min<uint64_t>(max_memory - std::min(max_memory, file_len), limits.max_bytes));
        b.header = Json::parse(std::string(reinterpret_cast<const char*>(file + 16), header_len), limits);
    } catch (const std::exception& e) {
        throw fail(std::string("bad header, not JSON: ") + e.what());
    }
    const uint64_t data_start = (16 + header_len + 63) / 64 * 64;  // header_len <= file size: no overflow
    const uint64_t data_len = file_len > data_start ? file_len - data_start : 0;
    const uint8_t* data = file + std::min(data_start, file_len);
    uint64_t data_bytes = 0;

    try {
        const Json& h = b.header;
        check_keys(h, b.version);
        const Json& quant = h.at("quant");
        read_quant(quant, b);
        b.config = ModelConfig::from_json(h.at("config"), b.int4);
        const ModelConfig& c = b.config;
        read_drafter(h.at("drafter"), b);
        const size_t max_tokens = static_cast<size_t>(c.max_seq_len) - 1;  // room for one generated token
        b.prompt = read_tokens(h.at("prompt"), "prompt", c.vocab_size, max_tokens);
        if (b.prompt.empty()) throw std::runtime_error("prompt: empty");
        read_tokens(h.at("golden"), "golden", c.vocab_size, static_cast<size_t>(c.max_seq_len) - b.prompt.size());
        data_bytes = static_cast<uint64_t>(int_in(h.at("data_bytes"), "data_bytes", 0, INT64_MAX));
        if (data_bytes > data_len)
            throw std::runtime_error("truncated: the data section should hold " + std::to_string(data_bytes) + " bytes, the file has " +
                                     std::to_string(data_len));
        if (b.version == 1 && (!h.at("data_sha256").is_string() || h.at("data_sha256").as_string().size() != 64))
            throw std::runtime_error("data_sha256: expected 64 hex digits, got " + describe(h.at("data_sha256")));
        const Json& table = h.at("tensors");
        if (!table.is_array()) throw std::runtime_error(std::string("tensors: expected an array, got ") + table.type_name());
        if (table.items().size() > kMaxTensors) throw std::runtime_error("tensors: more than " + std::to_string(kMaxTensors) + " entries");
        for (size_t i = 0; i < table.items().size(); ++i) {
            TensorView v = read_tensor(table.items()[i], i, data, data_bytes);
            if (!b.by_name.emplace(v.name, b.tensors.size()).second)
                throw std::runtime_error("tensor " + printable(v.name) + ": listed twice in the tensor table");
            b.weight_bytes = checked_add(b.weight_bytes, v.nbytes, "the tensors' total bytes");
            b.tensors.push_back(std::move(v));
        }
    } catch (const std::exception& e) {
        const std::string what = e.what();
        throw fail(what.rfind("truncated", 0) == 0 || what.rfind("tensor", 0) == 0 ? what : "bad header: " + what);
    }
    try {
        check_tensor_set(b);
    } catch (const std::exception& e) {
        throw fail(e.what());
    }

    // The layout: tensors in table order, each at the next multiple of 64 after the previous one,
    // zero fill between; data_bytes ends at the last one; the file ends where its version says.
    if (!all_zero(file + 16 + header_len, data_start - 16 - header_len)) throw fail("nonzero fill byte between the header and the data section");
    uint64_t end = 0;
    for (const TensorView& t : b.tensors) {
        const uint64_t offset = static_cast<uint64_t>(static_cast<const uint8_t*>(t.data) - data), want = (end + 63) / 64 * 64;
        if (offset != want)
            throw fail("tensor " + printable(t.name) + ": offset " + std::to_string(offset) + ", the layout puts it at " + std::to_string(want) +
                       " (tensors follow each other in table order, 64-aligned)");
        if (!all_zero(data + end, offset - end)) throw fail("nonzero fill byte before tensor " + printable(t.name));
        end = offset + t.nbytes;
    }
    if (end != data_bytes) throw fail("bad header: data_bytes " + std::to_string(data_bytes) + ", the last tensor ends at " + std::to_string(end));
    const uint64_t data_end = data_start + data_bytes;
    const uint8_t* index = nullptr;  // v2: the index's per-tensor hashes
    if (b.version == 1) {
        if (file_len > data_end)
            throw fail(std::to_string(file_len - data_end) + " bytes after the data section: the file is longer than its header says (" +
                       std::to_string(data_end) + " bytes)");
    } else {
        const uint64_t index_start = (data_end + 63) / 64 * 64;
        const uint64_t count = b.tensors.size(), need = index_start + 8 + 32 * count + 32;  // count <= kMaxTensors: no overflow
        if (file_len < index_start + 8)
            throw fail("truncated: the index starts at " + std::to_string(index_start) + ", the file has " + std::to_string(file_len) + " bytes");
        if (!all_zero(file + data_end, index_start - data_end)) throw fail("nonzero fill byte between the data section and the index");
        if (std::memcmp(file + index_start, "KDTI", 4) != 0)
            throw fail("bad index magic at byte " + std::to_string(index_start) + " (expected 'KDTI')");
        if (read_le(file + index_start + 4, 4) != count)
            throw fail("index count mismatch: the index holds " + std::to_string(read_le(file + index_start + 4, 4)) + " hashes, the header lists " +
                       std::to_string(count) + " tensors");
        if (file_len < need)
            throw fail("truncated: the index ends at " + std::to_string(need) + ", the file has " + std::to_string(file_len) + " bytes");
        if (file_len > need)
            throw fail(std::to_string(file_len - need) + " bytes after the index: the file is longer than its header says (" + std::to_string(need) +
                       " bytes)");
        Sha256 digest;
        digest.update(file, data_start);
        digest.update(file + index_start, need - 32 - index_start);
        b.digest = digest.digest();
        if (std::memcmp(b.digest.data(), file + need - 32, 32) != 0)
            throw fail("bundle digest mismatch: the index's digest differs from the sha256 of the header and index");
        index = file + index_start + 8;
    }
    if (b.version == 1 && hex(sha256(data, data_bytes)) != b.header.at("data_sha256").as_string())
        throw fail("data_sha256 mismatch: the data section's sha256 is " + hex(sha256(data, data_bytes)).substr(0, 16) + "..., the header says " +
                   printable(b.header.at("data_sha256").as_string().substr(0, 16)) + "...");
    try {
        check_in_parallel(b.tensors, [&](size_t i) { return check_tensor(b.tensors[i], index ? index + 32 * i : nullptr); });
    } catch (const std::exception& e) {
        throw fail(e.what());
    }
    b.check_memory(static_cast<int>(b.prompt.size()));
    b.check_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return b;
}

std::string Bundle::identity() const { return version == 1 ? hex(sha256(bytes.data(), bytes.size())) : hex(digest); }

uint64_t Bundle::check_memory(int max_batch) const {
    uint64_t need = 0, buffers = 0;
    try {
        buffers = model_buffer_bytes(config, drafter_block, max_batch);
        need = checked_add(checked_add(bytes.size(), weight_bytes, "memory"), buffers, "memory");
    } catch (const std::exception& e) {
        throw std::runtime_error("bundle " + printable(path, 200) + ": the config asks for more memory than 64 bits count (" + e.what() + ")");
    }
    if (need > max_memory)
        throw std::runtime_error("bundle " + printable(path, 200) + ": a run with " + std::to_string(max_batch) + " rows per forward needs " +
                                 std::to_string(need >> 20) + " MiB (file " + std::to_string(bytes.size() >> 20) + " MiB, weights " +
                                 std::to_string(weight_bytes >> 20) + " MiB, KV caches and buffers " + std::to_string(buffers >> 20) +
                                 " MiB for max_seq_len " + std::to_string(config.max_seq_len) + "), over --max-memory " +
                                 std::to_string(max_memory >> 20) + " MiB");
    return need;
}

void Bundle::check_tokens(const std::vector<int32_t>& tokens, const std::string& what) const {
    for (size_t i = 0; i < tokens.size(); ++i)
        if (tokens[i] < 0 || tokens[i] >= config.vocab_size)
            throw std::runtime_error(what + ": token " + std::to_string(tokens[i]) + " (item " + std::to_string(i) +
                                     ") is outside the vocabulary [0, " + std::to_string(config.vocab_size) + ") of bundle " +
                                     printable(path, 200));
}

bool Bundle::has(const std::string& name) const { return by_name.count(name) != 0; }

const TensorView& Bundle::get(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape) const {
    const auto it = by_name.find(name);
    if (it != by_name.end()) {
        const TensorView& t = tensors[it->second];
        if (t.dtype != dtype || t.shape != shape)
            throw std::runtime_error("bundle " + printable(path, 200) + ": tensor " + name + " is " + t.dtype + " " + shape_text(t.shape) +
                                     ", expected " + dtype + " " + shape_text(shape));
        return t;
    }
    throw std::runtime_error("bundle " + printable(path, 200) + ": missing tensor " + name);
}

std::vector<int32_t> Bundle::golden() const {
    const Json* g = header.find("golden");
    if (!g) return {};
    return read_tokens(*g, "golden", config.vocab_size, static_cast<size_t>(config.max_seq_len));
}

}  // namespace kd
