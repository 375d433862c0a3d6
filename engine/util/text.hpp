// How partrain writes values and errors in messages: dtype names as Lua sees them, NaNs as Lua
// prints them, and an exception's message without LibTorch's C++ backtrace.
#pragma once

#include <exception>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

namespace partrain::util {

/// The name partrain gives a dtype in messages and in Lua ("float32", "bfloat16", "int64", ...).
std::string dtype_name(c10::ScalarType t);

/// `text` with each "-nan" that stands alone as a number written "nan", as Lua writes a NaN: C++
/// streams write one whose sign bit is set (0/0 makes one) "-nan", and a NaN has no sign to speak
/// of. A name that holds "-nan" ("a-nan.txt", "'-nan'") is left as it is.
std::string unsigned_nan(std::string text);

/// An exception's message without LibTorch's C++ backtrace, a NaN in it written "nan" as Lua
/// writes it (C++ streams write one with its sign bit set "-nan").
std::string message_of(const std::exception& e);

/// The word of `words` nearest to `word` in edit distance, for "did you mean" ("--thread" ->
/// "--threads"), or "" when none is within a third of its length (at least 1). A word of over 64
/// characters gets none: no name is that long, and the distance costs its length.
std::string nearest_word(const std::vector<std::string>& words, const std::string& word);

}  // namespace partrain::util
