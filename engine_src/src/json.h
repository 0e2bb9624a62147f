// json.h: a small JSON value, parser and writer (enough for KDTR headers, manifests and reports).
// The parser is strict (README.md, "Input validation"): RFC 8259 grammar plus the NaN /
// Infinity / -Infinity literals Python writes; a nesting depth and a memory limit; integers kept
// exactly as int64 when they fit; string escapes and UTF-8 checked; duplicate keys refused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kd {

// What one parse may use: nesting levels, and bytes of memory for the parsed values
// (sizeof(Json) per value plus string and key bytes, counted as they are made).
struct JsonLimits {
    int max_depth = 256;
    size_t max_bytes = size_t{256} << 20;
};

class Json {
public:
    enum class Type { Null, Bool, Number, String, Array, Object };

    Json() = default;
    Json(bool b) : type_(Type::Bool), bool_(b) {}
    Json(double d) : type_(Type::Number), number_(d) {}
    Json(int i) : Json(static_cast<long long>(i)) {}
    Json(long i) : Json(static_cast<long long>(i)) {}
    Json(long long i) : type_(Type::Number), integer_(true), int_(i), number_(static_cast<double>(i)) {}
    Json(unsigned long i) : Json(static_cast<double>(i)) {}
    Json(const char* s) : type_(Type::String), string_(s) {}
    Json(std::string s) : type_(Type::String), string_(std::move(s)) {}
    static Json array() { Json j; j.type_ = Type::Array; return j; }
    static Json object() { Json j; j.type_ = Type::Object; return j; }
    template <class T>
    static Json array_of(const std::vector<T>& v) {
        Json j = array();
        for (const T& x : v) j.push(Json(x));
        return j;
    }

    // Throws std::runtime_error("json: <problem> at offset N") on malformed text or a limit hit.
    static Json parse(const std::string& text, const JsonLimits& limits = JsonLimits());
    // The file at path (at most max_file_bytes), parsed; throws std::runtime_error naming `what`
    // and the path when it cannot be read, is too large or does not parse.
    static Json parse_file(const std::string& path, const std::string& what, size_t max_file_bytes = size_t{64} << 20);
    // Compact when indent < 0, else pretty-printed with that many spaces per level.
    std::string dump(int indent = -1) const;

    Type type() const { return type_; }
    bool is_null() const { return type_ == Type::Null; }
    bool is_bool() const { return type_ == Type::Bool; }
    bool is_number() const { return type_ == Type::Number; }
    // A number that is a whole value in int64's range (as_int succeeds).
    bool is_integer() const;
    bool is_string() const { return type_ == Type::String; }
    bool is_array() const { return type_ == Type::Array; }
    bool is_object() const { return type_ == Type::Object; }
    // "null", "boolean", "number", "string", "array" or "object".
    const char* type_name() const;

    // Typed accessors throw std::runtime_error("json: expected <type>, got <type>") on a mismatch;
    // as_int also when the number is not a whole value in [-2^63, 2^63).
    bool as_bool() const;
    double as_number() const;
    int64_t as_int() const;
    const std::string& as_string() const;
    const std::vector<Json>& items() const;
    const std::vector<std::pair<std::string, Json>>& members() const;

    bool has(const std::string& key) const;
    // Object member (O(log n)); throws std::runtime_error("json: missing key '<key>'") when absent.
    const Json& at(const std::string& key) const;
    // The member, or null when absent (object only).
    const Json* find(const std::string& key) const;
    const Json& at(size_t i) const;
    size_t size() const;

    Json& push(Json v);                              // appends to an array
    Json& set(const std::string& key, Json v);       // inserts or replaces in an object (keeps order)

private:
    friend class JsonParser;
    void dump_to(std::string& out, int indent, int depth) const;
    // Position in index_ where key is or would go.
    size_t lower_bound(const std::string& key) const;

    Type type_ = Type::Null;
    bool bool_ = false;
    bool integer_ = false;  // int_ holds the exact value
    int64_t int_ = 0;
    double number_ = 0;
    std::string string_;
    std::vector<Json> array_;
    std::vector<std::pair<std::string, Json>> object_;  // in document order
    std::vector<uint32_t> index_;                       // object_ positions sorted by key
};

// What v is, for an error message: a number as written (integers exactly, others with 17
// significant digits, "nan" and "inf" included), anything else by its type name.
std::string describe(const Json& v);

// s made safe to quote in an error message: at most max_chars characters, control and non-ASCII
// bytes as \xNN, with "..." when cut.
std::string printable(const std::string& s, size_t max_chars = 80);

}  // namespace kd
