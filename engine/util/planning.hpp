// Whether this process is a plan's dry run (`partrain plan`): parameters are made on the meta
// device, collectives are recorded and not run, and the first optimizer step ends the script.
// A flag every layer may read; engine/plan turns it on (plan::set_planning).
#pragma once

namespace partrain::util {

namespace detail {
extern bool planning;
}
/// Whether this process is planning. Inline: every tensor crossing from Lua asks.
inline bool planning() { return detail::planning; }
/// Sets the flag alone; plan::set_planning also installs what planning needs.
void set_planning_flag(bool on);

}  // namespace partrain::util
