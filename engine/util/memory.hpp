// How much memory this process may use: the machine's, or less where a container's cgroup says so.
#pragma once

#include <string>

namespace partrain::util {

struct MemoryLimit {
  double bytes = 0;  ///< 0: unknown
  std::string what;  ///< "this machine's 25.3 GB of memory", "the 8 GB of memory its cgroup allows (...)"
};

/// The smaller of the machine's physical memory and the memory limit of the cgroup this process
/// runs in (v1's memory.limit_in_bytes or v2's memory.max, on its own cgroup and every one above
/// it), as Docker and Kubernetes set. Past it, Linux's out-of-memory killer ends the process with
/// no message. The files are read from `proc_cgroup` and below `cgroup_root` (tests give others).
MemoryLimit memory_limit(const std::string& proc_cgroup = "/proc/self/cgroup",
                         const std::string& cgroup_root = "/sys/fs/cgroup");

}  // namespace partrain::util
