// The planning flag (planning.hpp).
#include "engine/util/planning.hpp"

namespace partrain::util {

namespace detail {
bool planning = false;
}

void set_planning_flag(bool on) { detail::planning = on; }

}  // namespace partrain::util
