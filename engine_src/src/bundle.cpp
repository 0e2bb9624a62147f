// bundle.cpp: KDTR reader. Everything in a bundle is checked before the engine allocates for it
// (docs/engine/scripts.md, "Input validation"); every failure names the file and what is wrong with it.
#include "bundle.h"
#include "checked.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <algorithm>

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
    if (v.dtype == "f32") {
        const float* f = static_cast<const float*>(v.data);
        for (uint64_t k = 0; k < count; ++k) {
            float x;
            std::memcpy(&x, f + k, sizeof x);
            if (!std::isfinite(x)) throw std::runtime_error(tw + ": element " + std::to_string(k) + " is not finite");
        }
    }
    return v;
}

}  // namespace

Bundle Bundle::load(const std::string& path, uint64_t max_memory) {
    const std::string name = "bundle " + printable(path, 200);
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error(name + ": cannot open the file");
    in.seekg(0, std::ios::end);
    const std::streamoff size = in.tellg();
    if (size < 0) throw std::runtime_error(name + ": cannot read the file (not a regular file)");
    if (static_cast<uint64_t>(size) > max_memory)
        throw std::runtime_error(name + ": the file is " + std::to_string(size) + " bytes, over --max-memory " + std::to_string(max_memory));
    std::vector<uint8_t> bytes(static_cast<size_t>(size));
    in.seekg(0);
    if (size > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), size)) throw std::runtime_error(name + ": cannot read the file");
    return from_bytes(path, std::move(bytes), max_memory);
}

Bundle Bundle::from_bytes(const std::string& path, std::vector<uint8_t> bytes, uint64_t max_memory) {
    const auto fail = [&](const std::string& what) -> std::runtime_error {
        return std::runtime_error("bundle " + printable(path, 200) + ": " + what);
    };
    Bundle b;
    b.path = path;
    b.max_memory = max_memory;
    b.bytes = std::move(bytes);
    const uint64_t file_len = b.bytes.size();
    if (file_len < 16) throw fail("truncated: " + std::to_string(file_len) + " bytes, shorter than the 16-byte preamble");
    if (std::memcmp(b.bytes.data(), "KDTR", 4) != 0) throw fail("bad magic (expected 'KDTR'): not a KDTR bundle");
    const uint64_t version = read_le(b.bytes.data() + 4, 4);
    if (version != 1) throw fail("unsupported version " + std::to_string(version) + " (this engine reads version 1)");
    const uint64_t header_len = read_le(b.bytes.data() + 8, 8);
    if (header_len > file_len - 16)
        throw fail("truncated: header length " + std::to_string(header_len) + " runs past the end of the file (" +
                   std::to_string(file_len) + " bytes)");
    if (header_len > kMaxHeaderBytes)
        throw fail("header length " + std::to_string(header_len) + " is over the limit of " + std::to_string(kMaxHeaderBytes));
    try {
        JsonLimits limits;
        limits.max_bytes = static_cast<size_t>(std::min<uint64_t>(max_memory - std::min(max_memory, file_len), limits.max_bytes));
        b.header = Json::parse(std::string(reinterpret_cast<const char*>(b.bytes.data() + 16), header_len), limits);
    } catch (const std::exception& e) {
        throw fail(std::string("bad header, not JSON: ") + e.what());
    }
    const uint64_t data_start = (16 + header_len + 63) / 64 * 64;  // header_len <= file size: no overflow
    const uint64_t data_len = file_len > data_start ? file_len - data_start : 0;

    try {
        const Json& h = b.header;
        const Json& quant = member(h, "header", "quant");
        const std::string& type = string_of(member(quant, "quant", "type"), "quant.type");
        if (type != "fp32" && type != "int4") throw std::runtime_error("quant.type: unknown quant type '" + printable(type) + "'");
        b.int4 = type == "int4";
        if (b.int4 && quant.has("group_size")) int_in(quant.at("group_size"), "quant.group_size", 32, 32);
        b.config = ModelConfig::from_json(member(h, "header", "config"), b.int4);
        const ModelConfig& c = b.config;
        const Json& drafter = member(h, "header", "drafter");
        b.drafter_block = static_cast<int>(int_in(member(drafter, "drafter", "block_size"), "drafter.block_size", 1, 256));
        checked_int_mul(b.drafter_block, c.vocab_size, "drafter.block_size x config.vocab_size");
        b.mask_token = static_cast<int>(int_in(member(drafter, "drafter", "mask_token"), "drafter.mask_token", 0, c.vocab_size - 1));
        const size_t max_tokens = static_cast<size_t>(c.max_seq_len) - 1;  // room for one generated token
        b.prompt = read_tokens(member(h, "header", "prompt"), "prompt", c.vocab_size, max_tokens);
        if (b.prompt.empty()) throw std::runtime_error("prompt: empty");
        if (const Json* golden = h.find("golden"))
            read_tokens(*golden, "golden", c.vocab_size, static_cast<size_t>(c.max_seq_len) - b.prompt.size());
        uint64_t data_bytes = data_len;
        if (const Json* db = h.find("data_bytes")) {
            data_bytes = static_cast<uint64_t>(int_in(*db, "data_bytes", 0, INT64_MAX));
            if (data_bytes > data_len)
                throw std::runtime_error("truncated: the data section should hold " + std::to_string(data_bytes) +
                                         " bytes, the file has " + std::to_string(data_len));
        }
        const Json& table = member(h, "header", "tensors");
        if (!table.is_array()) throw std::runtime_error(std::string("tensors: expected an array, got ") + table.type_name());
        if (table.items().size() > kMaxTensors) throw std::runtime_error("tensors: more than " + std::to_string(kMaxTensors) + " entries");
        const uint8_t* data = b.bytes.data() + std::min(data_start, file_len);
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
    b.check_memory(static_cast<int>(b.prompt.size()));
    return b;
}

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
