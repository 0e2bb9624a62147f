// json.cpp: recursive-descent parser and writer for json.h.
#include "json.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace kd {
namespace {

class Parser {
public:
    explicit Parser(const std::string& text) : s_(text) {}

    Json parse_document() {
        Json v = parse_value();
        skip_space();
        if (pos_ != s_.size()) fail("trailing characters");
        return v;
    }

private:
    [[noreturn]] void fail(const std::string& what) const {
        throw std::runtime_error("json: " + what + " at offset " + std::to_string(pos_));
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

    Json parse_value() {
        skip_space();
        if (pos_ >= s_.size()) fail("unexpected end");
        const char c = s_[pos_];
        if (c == '{') return parse_object();
        if (c == '[') return parse_array();
        if (c == '"') return Json(parse_string());
        if (literal("true")) return Json(true);
        if (literal("false")) return Json(false);
        if (literal("null")) return Json();
        if (literal("NaN")) return Json(NAN);
        if (literal("Infinity")) return Json(INFINITY);
        if (literal("-Infinity")) return Json(-INFINITY);
        return parse_number();
    }

    Json parse_number() {
        const size_t start = pos_;
        if (pos_ < s_.size() && (s_[pos_] == '-' || s_[pos_] == '+')) ++pos_;
        while (pos_ < s_.size() && (isdigit(static_cast<unsigned char>(s_[pos_])) || s_[pos_] == '.' ||
                                    s_[pos_] == 'e' || s_[pos_] == 'E' || s_[pos_] == '-' || s_[pos_] == '+'))
            ++pos_;
        if (start == pos_) fail("unexpected character");
        try {
            return Json(std::stod(s_.substr(start, pos_ - start)));
        } catch (const std::exception&) {
            pos_ = start;
            fail("bad number");
        }
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
    unsigned parse_hex4() {
        if (pos_ + 4 > s_.size()) fail("truncated \\u escape");
        const unsigned v = static_cast<unsigned>(std::stoul(s_.substr(pos_, 4), nullptr, 16));
        pos_ += 4;
        return v;
    }

    std::string parse_string() {
        expect('"');
        std::string out;
        while (true) {
            if (pos_ >= s_.size()) fail("unterminated string");
            const char c = s_[pos_++];
            if (c == '"') return out;
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
                    if (cp >= 0xD800 && cp < 0xDC00 && literal("\\u")) cp = 0x10000 + ((cp - 0xD800) << 10) + (parse_hex4() - 0xDC00);
                    append_utf8(out, cp);
                    break;
                }
                default: fail("bad escape");
            }
        }
    }

    Json parse_array() {
        expect('[');
        Json a = Json::array();
        if (consume(']')) return a;
        do a.push(parse_value()); while (consume(','));
        expect(']');
        return a;
    }

    Json parse_object() {
        expect('{');
        Json o = Json::object();
        if (consume('}')) return o;
        do {
            skip_space();
            std::string key = parse_string();
            expect(':');
            o.set(key, parse_value());
        } while (consume(','));
        expect('}');
        return o;
    }

    const std::string& s_;
    size_t pos_ = 0;
};

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
                    std::snprintf(buf, sizeof buf, "\\u%04x", c);
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
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", d);
    out += buf;
}

}  // namespace

Json Json::parse(const std::string& text) { return Parser(text).parse_document(); }

Json Json::parse_file(const std::string& path, const std::string& what) {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot read " + what + " " + path);
    std::stringstream text;
    text << in.rdbuf();
    return parse(text.str());
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
        case Type::Number: dump_number(out, number_); break;
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

bool Json::as_bool() const {
    if (type_ != Type::Bool) throw std::runtime_error("json: expected a boolean");
    return bool_;
}
double Json::as_number() const {
    if (type_ != Type::Number) throw std::runtime_error("json: expected a number");
    return number_;
}
int64_t Json::as_int() const {
    const double d = as_number();
    if (d != std::floor(d)) throw std::runtime_error("json: expected an integer, got " + std::to_string(d));
    return static_cast<int64_t>(d);
}
const std::string& Json::as_string() const {
    if (type_ != Type::String) throw std::runtime_error("json: expected a string");
    return string_;
}
const std::vector<Json>& Json::items() const {
    if (type_ != Type::Array) throw std::runtime_error("json: expected an array");
    return array_;
}
const std::vector<std::pair<std::string, Json>>& Json::members() const {
    if (type_ != Type::Object) throw std::runtime_error("json: expected an object");
    return object_;
}
std::vector<int32_t> Json::as_int_vector() const {
    std::vector<int32_t> out;
    for (const Json& v : items()) out.push_back(static_cast<int32_t>(v.as_int()));
    return out;
}
bool Json::has(const std::string& key) const {
    if (type_ != Type::Object) return false;
    for (const auto& kv : object_)
        if (kv.first == key) return true;
    return false;
}
const Json& Json::at(const std::string& key) const {
    for (const auto& kv : members())
        if (kv.first == key) return kv.second;
    throw std::runtime_error("json: missing key '" + key + "'");
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
    for (auto& kv : object_)
        if (kv.first == key) { kv.second = std::move(v); return *this; }
    object_.emplace_back(key, std::move(v));
    return *this;
}

}  // namespace kd
