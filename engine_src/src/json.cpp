// json.cpp: a strict recursive-descent parser (depth-limited) and the writer for json.h.
#include "json.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>

namespace kd {

class JsonParser {
public:
    JsonParser(const std::string& text, const JsonLimits& limits) : s_(text), limits_(limits) {}

    Json parse_document() {
        Json v = parse_value(0);
        skip_space();
        if (pos_ != s_.size()) fail("trailing characters");
        return v;
    }

private:
    [[noreturn]] void fail(const std::string& what) const {
        throw std::runtime_error("json: " + what + " at offset " + std::to_string(pos_));
    }
    void charge(size_t bytes) {
        used_ += bytes;
        if (used_ > limits_.max_bytes)
            fail("the document needs more than " + std::to_string(limits_.max_bytes >> 20) + " MiB in memory");
    }
    void skip_space() {
        while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\r' || s_[pos_] == '\t')) ++pos_;
    }
    bool consume(char c) {
        skip_space();
        if (pos_ < s_.size() && s_[pos_] == c) { ++pos_; return true; }
        return false;
    }
    void expect(char c) {
        if (!consume(c)) fail(std::string("expected '") + c + "'");
    }
    bool literal(const char* word) {
        const std::string w(word);
        if (s_.compare(pos_, w.size(), w) == 0) { pos_ += w.size(); return true; }
        return false;
    }
    bool digit_at(size_t p) const { return p < s_.size() && s_[p] >= '0' && s_[p] <= '9'; }

    Json parse_value(int depth) {
        if (depth > limits_.max_depth) fail("nesting deeper than " + std::to_string(limits_.max_depth) + " levels");
        charge(sizeof(Json));
        skip_space();
        if (pos_ >= s_.size()) fail("unexpected end");
        const char c = s_[pos_];
        if (c == '{') return parse_object(depth);
        if (c == '[') return parse_array(depth);
        if (c == '"') return Json(parse_string());
        if (literal("true")) return Json(true);
        if (literal("false")) return Json(false);
        if (literal("null")) return Json();
        // Python's json writes these for non-finite floats; they are numbers no integer accepts.
        if (literal("NaN")) return Json(NAN);
        if (literal("Infinity")) return Json(INFINITY);
        if (literal("-Infinity")) return Json(-INFINITY);
        return parse_number();
    }

    // -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?, integers kept exactly when they fit int64.
    Json parse_number() {
        const size_t start = pos_;
        if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
        if (!digit_at(pos_)) fail(pos_ == start ? "unexpected character" : "bad number");
        if (s_[pos_] == '0') ++pos_;
        else while (digit_at(pos_)) ++pos_;
        bool whole = true;
        if (pos_ < s_.size() && s_[pos_] == '.') {
            whole = false;
            if (!digit_at(++pos_)) fail("bad number (no digit after '.')");
            while (digit_at(pos_)) ++pos_;
        }
        if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
            whole = false;
            ++pos_;
            if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
            if (!digit_at(pos_)) fail("bad number (no digit in the exponent)");
            while (digit_at(pos_)) ++pos_;
        }
        const std::string text = s_.substr(start, pos_ - start);
        if (whole) {
            int64_t v = 0;
            bool fits = true;
            const bool negative = text[0] == '-';
            for (size_t i = negative ? 1 : 0; i < text.size() && fits; ++i) {
                const int d = text[i] - '0';
                fits = !__builtin_mul_overflow(v, 10, &v) && !__builtin_add_overflow(v, negative ? -d : d, &v);
            }
            if (fits) return Json(static_cast<long long>(v));
        }
        errno = 0;
        const double d = std::strtod(text.c_str(), nullptr);
        // Underflow (subnormals, or below them to 0) is an ordinary rounding; overflow is not.
        if (errno == ERANGE && std::isinf(d)) {
            pos_ = start;
            fail("number " + printable(text, 40) + " is out of range");
        }
        return Json(d);
    }

    static void append_utf8(std::string& out, unsigned cp) {
        if (cp < 0x80) out += static_cast<char>(cp);
        else if (cp < 0x800) { out += static_cast<char>(0xC0 | (cp >> 6)); out += static_cast<char>(0x80 | (cp & 0x3F)); }
        else if (cp < 0x10000) {
            out += static_cast<char>(0xE0 | (cp >> 12));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
        } else {
            out += static_cast<char>(0xF0 | (cp >> 18));
            out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
        }
    }
    unsigned parse_hex4() {  // the 4 hex digits after "\u"
        unsigned v = 0;
        for (int i = 0; i < 4; ++i) {
            const char c = pos_ < s_.size() ? s_[pos_] : '\0';
            int d = -1;
            if (c >= '0' && c <= '9') d = c - '0';
            else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
            else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
            if (d < 0) fail("bad \\u escape (expected 4 hex digits)");
            v = v * 16 + static_cast<unsigned>(d);
            ++pos_;
        }
        return v;
    }
    // One UTF-8 encoded character starting at pos_ (its first byte >= 0x80), checked and copied.
    void copy_utf8(std::string& out) {
        const auto byte = [&](size_t p) { return p < s_.size() ? static_cast<unsigned char>(s_[p]) : 0u; };
        const unsigned b0 = byte(pos_);
        int n = 0;
        unsigned cp = 0, min = 0;
        if (b0 >= 0xC2 && b0 <= 0xDF) { n = 1; cp = b0 & 0x1F; min = 0x80; }
        else if (b0 >= 0xE0 && b0 <= 0xEF) { n = 2; cp = b0 & 0x0F; min = 0x800; }
        else if (b0 >= 0xF0 && b0 <= 0xF4) { n = 3; cp = b0 & 0x07; min = 0x10000; }
        else fail("invalid UTF-8 byte in string");
        for (int i = 1; i <= n; ++i) {
            const unsigned b = byte(pos_ + i);
            if ((b & 0xC0) != 0x80) fail("invalid UTF-8 sequence in string");
            cp = (cp << 6) | (b & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) fail("invalid UTF-8 sequence in string");
        out.append(s_, pos_, static_cast<size_t>(n) + 1);
        pos_ += static_cast<size_t>(n) + 1;
    }

    std::string parse_string() {
        expect('"');
        std::string out;
        while (true) {
            if (pos_ >= s_.size()) fail("unterminated string");
            const char c = s_[pos_];
            if (c == '"') { ++pos_; break; }
            if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
            if (static_cast<unsigned char>(c) >= 0x80) { copy_utf8(out); continue; }
            ++pos_;
            if (c != '\\') { out += c; continue; }
            if (pos_ >= s_.size()) fail("unterminated escape");
            const char e = s_[pos_++];
            switch (e) {
                case '"': out += '"'; break;
                case '\\': out += '\\'; break;
                case '/': out += '/'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'n': out += '\n'; break;
                case 'r': out += '\r'; break;
                case 't': out += '\t'; break;
                case 'u': {
                    unsigned cp = parse_hex4();
                    if (cp >= 0xDC00 && cp < 0xE000) fail("lone low surrogate in \\u escape");
                    if (cp >= 0xD800 && cp < 0xDC00) {
                        if (!literal("\\u")) fail("lone high surrogate in \\u escape");
                        const unsigned low = parse_hex4();
                        if (low < 0xDC00 || low >= 0xE000) fail("high surrogate not followed by a low one");
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
                    }
                    append_utf8(out, cp);
                    break;
                }
                default: fail("bad escape");
            }
        }
        charge(out.size());
        return out;
    }

    Json parse_array(int depth) {
        expect('[');
        Json a = Json::array();
        if (consume(']')) return a;
        do a.array_.push_back(parse_value(depth + 1)); while (consume(','));
        expect(']');
        return a;
    }

    Json parse_object(int depth) {
        expect('{');
        Json o = Json::object();
        if (!consume('}')) {
            do {
                skip_space();
                std::string key = parse_string();
                expect(':');
                o.object_.emplace_back(std::move(key), parse_value(depth + 1));
            } while (consume(','));
            expect('}');
        }
        charge(sizeof(uint32_t) * o.object_.size());
        o.index_.resize(o.object_.size());
        for (size_t i = 0; i < o.index_.size(); ++i) o.index_[i] = static_cast<uint32_t>(i);
        const auto& m = o.object_;
        std::stable_sort(o.index_.begin(), o.index_.end(), [&m](uint32_t a, uint32_t b) { return m[a].first < m[b].first; });
        for (size_t i = 1; i < o.index_.size(); ++i)
            if (m[o.index_[i]].first == m[o.index_[i - 1]].first)
                throw std::runtime_error("json: duplicate key '" + printable(m[o.index_[i]].first) + "' in the object ending at offset " +
                                         std::to_string(pos_));
        return o;
    }

    const std::string& s_;
    const JsonLimits limits_;
    size_t pos_ = 0;
    size_t used_ = 0;
};

namespace {

void dump_string(std::string& out, const std::string& s) {
    out += '"';
    for (const char c : s) {
        switch (c) {
            case '"': out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '\r': out += "\\r"; break;
            case '\t': out += "\\t"; break;
            default:
                if (static_cast<unsigned char>(c) < 0x20) {
                    char buf[8];
                    std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
                    out += buf;
                } else {
                    out += c;
                }
        }
    }
    out += '"';
}

void dump_number(std::string& out, double d) {
    if (!std::isfinite(d)) { out += "null"; return; }  // JSON has no NaN / Infinity
    if (d == std::floor(d) && std::fabs(d) < 1e15) {
        out += std::to_string(static_cast<long long>(d));
        return;
    }
    // The shortest text that reads back as the same double, so a dump parsed and dumped again is
    // the same text (fewer digits could read back as a whole number and print as one).
    char buf[32];
    for (int digits = 1; digits <= 17; ++digits) {
        std::snprintf(buf, sizeof buf, "%.*g", digits, d);
        if (std::strtod(buf, nullptr) == d) break;
    }
    out += buf;
}

[[noreturn]] void type_error(const char* want, const Json& got) {
    throw std::runtime_error(std::string("json: expected ") + want + ", got " + got.type_name());
}

}  // namespace

std::string describe(const Json& v) {
    if (!v.is_number()) return v.type_name();
    if (v.is_integer()) return std::to_string(v.as_int());
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", v.as_number());
    return buf;
}

std::string printable(const std::string& s, size_t max_chars) {
    std::string out;
    for (size_t i = 0; i < s.size() && i < max_chars; ++i) {
        const unsigned char c = static_cast<unsigned char>(s[i]);
        if (c >= 0x20 && c < 0x7F && c != '\\') {
            out += static_cast<char>(c);
        } else {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\x%02x", c);
            out += buf;
        }
    }
    if (s.size() > max_chars) out += "...";
    return out;
}

Json Json::parse(const std::string& text, const JsonLimits& limits) { return JsonParser(text, limits).parse_document(); }

Json Json::parse_file(const std::string& path, const std::string& what, size_t max_file_bytes) {
    const std::string name = what + " " + printable(path, 200);
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + name);
    in.seekg(0, std::ios::end);
    const std::streamoff size = in.tellg();
    if (size < 0) throw std::runtime_error("cannot read " + name + " (not a regular file)");
    if (static_cast<uint64_t>(size) > max_file_bytes)
        throw std::runtime_error(name + ": " + std::to_string(size) + " bytes, over the limit of " +
                                 std::to_string(max_file_bytes) + " for a JSON file");
    std::string text(static_cast<size_t>(size), '\0');
    in.seekg(0);
    if (!in.read(&text[0], size)) throw std::runtime_error("cannot read " + name);
    try {
        return parse(text);
    } catch (const std::exception& e) {
        throw std::runtime_error(name + ": " + e.what());
    }
}

std::string Json::dump(int indent) const {
    std::string out;
    dump_to(out, indent, 0);
    return out;
}

void Json::dump_to(std::string& out, int indent, int depth) const {
    const auto newline = [&](int d) {
        if (indent < 0) return;
        out += '\n';
        out.append(static_cast<size_t>(indent * d), ' ');
    };
    switch (type_) {
        case Type::Null: out += "null"; break;
        case Type::Bool: out += bool_ ? "true" : "false"; break;
        case Type::Number:
            if (integer_) out += std::to_string(int_);
            else dump_number(out, number_);
            break;
        case Type::String: dump_string(out, string_); break;
        case Type::Array: {
            // Arrays of scalars stay on one line: token lists read better that way.
            bool scalars = true;
            for (const Json& v : array_) scalars = scalars && !v.is_array() && !v.is_object();
            out += '[';
            for (size_t i = 0; i < array_.size(); ++i) {
                if (i) out += scalars || indent < 0 ? (indent < 0 ? "," : ", ") : ",";
                if (!scalars) newline(depth + 1);
                array_[i].dump_to(out, indent, depth + 1);
            }
            if (!scalars && !array_.empty()) newline(depth);
            out += ']';
            break;
        }
        case Type::Object: {
            out += '{';
            for (size_t i = 0; i < object_.size(); ++i) {
                if (i) out += ',';
                newline(depth + 1);
                dump_string(out, object_[i].first);
                out += indent < 0 ? ":" : ": ";
                object_[i].second.dump_to(out, indent, depth + 1);
            }
            if (!object_.empty()) newline(depth);
            out += '}';
            break;
        }
    }
}

const char* Json::type_name() const {
    switch (type_) {
        case Type::Null: return "null";
        case Type::Bool: return "boolean";
        case Type::Number: return "number";
        case Type::String: return "string";
        case Type::Array: return "array";
        case Type::Object: return "object";
    }
    return "?";
}

bool Json::is_integer() const {
    if (type_ != Type::Number) return false;
    if (integer_) return true;
    // Whole doubles in [-2^63, 2^63): 2^63 itself is the first value int64 cannot hold.
    return std::isfinite(number_) && number_ == std::floor(number_) && number_ >= -9223372036854775808.0 &&
           number_ < 9223372036854775808.0;
}
bool Json::as_bool() const {
    if (type_ != Type::Bool) type_error("a boolean", *this);
    return bool_;
}
double Json::as_number() const {
    if (type_ != Type::Number) type_error("a number", *this);
    return number_;
}
int64_t Json::as_int() const {
    if (type_ != Type::Number) type_error("an integer", *this);
    if (integer_) return int_;
    if (!is_integer()) {
        char buf[40];
        std::snprintf(buf, sizeof buf, "%.17g", number_);
        throw std::runtime_error(std::string("json: expected an integer in [-2^63, 2^63), got ") + buf);
    }
    return static_cast<int64_t>(number_);
}
const std::string& Json::as_string() const {
    if (type_ != Type::String) type_error("a string", *this);
    return string_;
}
const std::vector<Json>& Json::items() const {
    if (type_ != Type::Array) type_error("an array", *this);
    return array_;
}
const std::vector<std::pair<std::string, Json>>& Json::members() const {
    if (type_ != Type::Object) type_error("an object", *this);
    return object_;
}
size_t Json::lower_bound(const std::string& key) const {
    const auto it = std::lower_bound(index_.begin(), index_.end(), key,
                                     [this](uint32_t i, const std::string& k) { return object_[i].first < k; });
    return static_cast<size_t>(it - index_.begin());
}
const Json* Json::find(const std::string& key) const {
    members();  // type check
    const size_t p = lower_bound(key);
    return p < index_.size() && object_[index_[p]].first == key ? &object_[index_[p]].second : nullptr;
}
bool Json::has(const std::string& key) const { return type_ == Type::Object && find(key) != nullptr; }
const Json& Json::at(const std::string& key) const {
    const Json* v = find(key);
    if (!v) throw std::runtime_error("json: missing key '" + printable(key) + "'");
    return *v;
}
const Json& Json::at(size_t i) const {
    if (i >= items().size()) throw std::runtime_error("json: index " + std::to_string(i) + " out of range");
    return array_[i];
}
size_t Json::size() const { return type_ == Type::Array ? array_.size() : members().size(); }

Json& Json::push(Json v) {
    if (type_ != Type::Array) throw std::runtime_error("json: push on a non-array");
    array_.push_back(std::move(v));
    return *this;
}
Json& Json::set(const std::string& key, Json v) {
    if (type_ != Type::Object) throw std::runtime_error("json: set on a non-object");
    const size_t p = lower_bound(key);
    if (p < index_.size() && object_[index_[p]].first == key) {
        object_[index_[p]].second = std::move(v);
        return *this;
    }
    index_.insert(index_.begin() + static_cast<long>(p), static_cast<uint32_t>(object_.size()));
    object_.emplace_back(key, std::move(v));
    return *this;
}

}  // namespace kd
