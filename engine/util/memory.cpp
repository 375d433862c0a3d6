// The memory limit (see memory.hpp).
#include "engine/util/memory.hpp"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <vector>

namespace partrain::util {

namespace {

// A limit file's number in bytes; 0 for "max", an unreadable file or anything else.
double read_limit(const std::string& path) {
  std::ifstream in(path);
  char text[32] = {};
  in.read(text, sizeof text - 1);
  std::string word(text, static_cast<size_t>(in.gcount()));
  while (!word.empty() && (word.back() == '\n' || word.back() == ' ')) word.pop_back();
  if (word.empty() || word.size() > 20) return 0;
  for (char c : word)
    if (c < '0' || c > '9') return 0;
  return std::stod(word);
}

std::string gigabytes(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g GB", bytes / 1e9);
  return text;
}

}  // namespace

MemoryLimit memory_limit(const std::string& proc_cgroup, const std::string& cgroup_root) {
  MemoryLimit limit;
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) {
    limit.bytes = static_cast<double>(pages) * static_cast<double>(page);
    limit.what = "this machine's " + gigabytes(limit.bytes) + " of memory";
  }
  // Lines "id:controllers:path": v1's memory controller ("4:memory:/docker/abc"), or v2's single
  // hierarchy ("0::/user.slice"). A container often sees its own cgroup at the root of the mount,
  // so each folder from the path up to the root is looked at, and the smallest limit counts.
  std::ifstream in(proc_cgroup);
  std::string line;
  while (std::getline(in, line)) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string id = line.substr(0, a), controllers = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1), file;
    std::vector<std::string> bases;
    std::istringstream names(controllers);
    bool memory = false;
    for (std::string name; std::getline(names, name, ',');) memory = memory || name == "memory";
    // v1 mounts a controller at /sys/fs/cgroup/memory, or several together at a folder named by
    // their list as this line gives it ("4:cpu,memory:/job" at /sys/fs/cgroup/cpu,memory).
    if (memory) {
      file = "memory.limit_in_bytes";
      bases.push_back(cgroup_root + "/memory");
      if (controllers != "memory" && controllers.find('/') == std::string::npos &&
          controllers.find("..") == std::string::npos)
        bases.push_back(cgroup_root + "/" + controllers);
    } else if (id == "0" && controllers.empty()) {
      file = "memory.max";
      bases.push_back(cgroup_root);
    } else {
      continue;
    }
    if (path.empty() || path[0] != '/' || path.find("/..") != std::string::npos) continue;
    while (true) {
      for (const std::string& base : bases) {
        const double bytes = read_limit(base + (path == "/" ? "" : path) + "/" + file);
        if (bytes > 0 && (limit.bytes <= 0 || bytes < limit.bytes)) {
          limit.bytes = bytes;
          limit.what = "the " + gigabytes(bytes) + " of memory its cgroup allows (a container's limit)";
        }
      }
      if (path == "/") break;
      path = path.substr(0, path.rfind('/'));
      if (path.empty()) path = "/";
    }
  }
  return limit;
}

}  // namespace partrain::util
