// json.h: a small JSON value, parser and writer (enough for KDTR headers, manifests and reports).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kd {

class Json {
public:
    enum class Type { Null, Bool, Number, String, Array, Object };

    Json() = default;
    Json(bool b) : type_(Type::Bool), bool_(b) {}
    Json(double d) : type_(Type::Number), number_(d) {}
    Json(int i) : Json(static_cast<double>(i)) {}
    Json(long i) : Json(static_cast<double>(i)) {}
    Json(long long i) : Json(static_cast<double>(i)) {}
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

    // Throws std::runtime_error("json: <problem> at offset N") on malformed text.
    static Json parse(const std::string& text);
    // The file at path, parsed; throws std::runtime_error naming `what` and the path when it
    // cannot be read, or the parse error.
    static Json parse_file(const std::string& path, const std::string& what);
    // Compact when indent < 0, else pretty-printed with that many spaces per level.
    std::string dump(int indent = -1) const;

    Type type() const { return type_; }
    bool is_null() const { return type_ == Type::Null; }
    bool is_number() const { return type_ == Type::Number; }
    bool is_string() const { return type_ == Type::String; }
    bool is_array() const { return type_ == Type::Array; }
    bool is_object() const { return type_ == Type::Object; }

    // Typed accessors throw std::runtime_error("json: expected <type>") on a mismatch.
    bool as_bool() const;
    double as_number() const;
    int64_t as_int() const;
    const std::string& as_string() const;
    const std::vector<Json>& items() const;
    const std::vector<std::pair<std::string, Json>>& members() const;
    std::vector<int32_t> as_int_vector() const;

    bool has(const std::string& key) const;
    // Object member; throws std::runtime_error("json: missing key '<key>'") when absent.
    const Json& at(const std::string& key) const;
    const Json& at(size_t i) const;
    size_t size() const;

    Json& push(Json v);                              // appends to an array
    Json& set(const std::string& key, Json v);       // inserts or replaces in an object (keeps order)

private:
    void dump_to(std::string& out, int indent, int depth) const;

    Type type_ = Type::Null;
    bool bool_ = false;
    double number_ = 0;
    std::string string_;
    std::vector<Json> array_;
    std::vector<std::pair<std::string, Json>> object_;
};

}  // namespace kd
