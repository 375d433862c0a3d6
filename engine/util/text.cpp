// The bodies behind text.hpp.
#include "engine/util/text.hpp"

#include <algorithm>

#include <c10/util/Exception.h>

namespace partrain::util {

std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return "float32";
    case c10::kDouble: return "float64";
    case c10::kHalf: return "float16";
    case c10::kBFloat16: return "bfloat16";
    case c10::kLong: return "int64";
    case c10::kInt: return "int32";
    case c10::kShort: return "int16";
    case c10::kChar: return "int8";
    case c10::kByte: return "uint8";
    case c10::kBool: return "bool";
    default: return c10::toString(t);
  }
}

std::string unsigned_nan(std::string text) {
  auto before = [](char c) {
    return c == ' ' || c == '(' || c == '[' || c == '{' || c == ',' || c == '=' || c == ':' || c == '\n';
  };
  auto after = [](char c) {
    return c == ' ' || c == ')' || c == ']' || c == '}' || c == ',' || c == ';' || c == ':' || c == '\n';
  };
  for (size_t at = text.find("-nan"); at != std::string::npos; at = text.find("-nan", at + 1)) {
    const size_t end = at + 4;
    if ((at == 0 || before(text[at - 1])) && (end == text.size() || after(text[end]) ||
                                              (text[end] == '.' && (end + 1 == text.size() || text[end + 1] == ' '))))
      text.erase(at, 1);
  }
  return text;
}

std::string message_of(const std::exception& e) {
  if (auto* c10 = dynamic_cast<const c10::Error*>(&e)) return unsigned_nan(c10->what_without_backtrace());
  return unsigned_nan(e.what());
}

namespace {
// The edit distance of two words (insertions, deletions, substitutions).
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}
}  // namespace

std::string nearest_word(const std::vector<std::string>& words, const std::string& word) {
  if (word.size() > 64) return "";
  std::string best;
  size_t best_distance = std::max<size_t>(1, word.size() / 3) + 1;
  for (const auto& w : words) {
    size_t d = edit_distance(word, w);
    if (d < best_distance) best_distance = d, best = w;
  }
  return best;
}

}  // namespace partrain::util
