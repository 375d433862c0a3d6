// A cereal input archive for bytes that may be damaged or hostile: it reads from memory and
// refuses any container size larger than the bytes left, so no size read from a file is trusted
// before the bytes behind it are seen. Reads what cereal::BinaryOutputArchive writes.
//
// cereal's BinaryInputArchive resizes a container to whatever size it reads: one flipped byte in
// a length makes it allocate gigabytes. Here a container's size is at most the bytes left (a
// string or a vector of numbers is allocated at most 8 times those bytes), and a vector of
// structures grows one parsed element at a time, so what is allocated stays a small multiple of
// the input's size. Use: `util::BoundedInputArchive ar(bytes.data(), bytes.size()); ar(value);`,
// then `ar.left()` is what was not read. to_bytes and from_bytes make the round trip of one value.
#pragma once

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <cereal/archives/binary.hpp>
#include <cereal/cereal.hpp>
#include <cereal/details/helpers.hpp>

namespace partrain::util {

class BoundedInputArchive : public cereal::InputArchive<BoundedInputArchive, cereal::AllowEmptyClassElision> {
 public:
  BoundedInputArchive(const char* data, size_t size)
      : cereal::InputArchive<BoundedInputArchive, cereal::AllowEmptyClassElision>(this), at_(data), left_(size) {}
  void loadBinary(void* out, size_t n) {
    if (n > left_)
      throw cereal::Exception("it needs " + std::to_string(n) + " more bytes where " + std::to_string(left_) +
                              " are left");
    std::memcpy(out, at_, n);
    at_ += n;
    left_ -= n;
  }
  size_t left() const { return left_; }

 private:
  const char* at_;
  size_t left_;
};

template <class T>
typename std::enable_if<std::is_arithmetic<T>::value>::type CEREAL_LOAD_FUNCTION_NAME(BoundedInputArchive& ar, T& t) {
  ar.loadBinary(std::addressof(t), sizeof(t));
}
template <class T>
void CEREAL_LOAD_FUNCTION_NAME(BoundedInputArchive& ar, cereal::BinaryData<T>& data) {
  ar.loadBinary(data.data, static_cast<size_t>(data.size));
}
// Names are not stored in a binary archive (std::pair wraps its members in them).
template <class T>
void CEREAL_LOAD_FUNCTION_NAME(BoundedInputArchive& ar, cereal::NameValuePair<T>& pair) {
  ar(pair.value);
}
template <class T>
void CEREAL_LOAD_FUNCTION_NAME(BoundedInputArchive& ar, cereal::SizeTag<T>& tag) {
  uint64_t n = 0;
  ar.loadBinary(&n, sizeof n);
  if (n > ar.left())
    throw cereal::Exception("a container of " + std::to_string(n) + " elements where only " +
                            std::to_string(ar.left()) + " bytes are left");
  tag.size = static_cast<typename std::remove_reference<T>::type>(n);
}
// Vectors of structures: appended one parsed element at a time (never resized up front).
template <class T, class A>
typename std::enable_if<!std::is_arithmetic<T>::value>::type CEREAL_LOAD_FUNCTION_NAME(BoundedInputArchive& ar,
                                                                                       std::vector<T, A>& out) {
  cereal::size_type n = 0;
  ar(cereal::make_size_tag(n));
  out.clear();
  for (cereal::size_type i = 0; i < n; ++i) {
    T value;
    ar(value);
    out.push_back(std::move(value));
  }
}

/// `value` as cereal::BinaryOutputArchive writes it.
template <class T>
std::string to_bytes(const T& value) {
  std::ostringstream out(std::ios::binary);
  {
    cereal::BinaryOutputArchive ar(out);
    ar(const_cast<T&>(value));
  }
  return out.str();
}

/// The value that to_bytes wrote into `bytes`, read with a BoundedInputArchive (bytes after it are
/// not looked at).
template <class T>
T from_bytes(const std::string& bytes) {
  T value;
  BoundedInputArchive ar(bytes.data(), bytes.size());
  ar(value);
  return value;
}

}  // namespace partrain::util
