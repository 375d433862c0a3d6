// The registry of model families (see registry.hpp): the one list every family joins.
#include "engine/models/registry.hpp"

#include <c10/util/Exception.h>

namespace partrain::models {

const std::vector<Family>& families() {
  static const std::vector<Family> all = {
      mlp_family(),    // engine/models/models.cpp
      gpt2_family(),   // engine/models/gpt2.cpp
      llama_family(),  // engine/models/llama.cpp
  };
  return all;
}

const Family& family(const std::string& name) {
  std::string known;
  for (const auto& f : families()) {
    if (f.name == name) return f;
    known += (known.empty() ? "" : ", ") + f.name;
  }
  TORCH_CHECK(false, "unknown model family '", name, "' (known: ", known, ")");
}

const Family* family_of_type(const std::string& type) {
  for (const auto& f : families())
    if (f.type == type) return &f;
  return nullptr;
}

}  // namespace partrain::models
