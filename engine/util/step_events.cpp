// The training step's observers and the calls that announce each phase to them.
#include "engine/util/step_events.hpp"

#include <algorithm>
#include <vector>

namespace partrain::events {

namespace {
std::vector<StepObserver*>& observers() {
  static std::vector<StepObserver*> all;  // made on first use: observers register from static init
  return all;
}
// By index, without a copy (a forward from Lua announces, once a module call): an observer added
// as they are called is called too; one removed then may make the next one miss this call.
template <class Fn>
void announce(Fn fn) {
  const auto& all = observers();
  for (size_t i = 0; i < all.size(); ++i) fn(*all[i]);
}
}  // namespace

void observe(StepObserver* observer) {
  auto& all = observers();
  if (std::find(all.begin(), all.end(), observer) == all.end()) all.push_back(observer);
}

void unobserve(StepObserver* observer) {
  auto& all = observers();
  all.erase(std::remove(all.begin(), all.end(), observer), all.end());
}

void train_step_begins() { announce([](StepObserver& o) { o.train_step_begins(); }); }
void train_step_ends(const std::string& row) { announce([&](StepObserver& o) { o.train_step_ends(row); }); }
void forward_begins() { announce([](StepObserver& o) { o.forward_begins(); }); }
void forward_ends() { announce([](StepObserver& o) { o.forward_ends(); }); }

Aside::Aside() { announce([](StepObserver& o) { o.aside_begins(); }); }
Aside::~Aside() {
  // In reverse, as scopes end. An observer added during the aside is told it ends without having
  // seen it begin: aside_ends must allow that (the planner's does nothing then).
  const auto now = observers();
  for (auto it = now.rbegin(); it != now.rend(); ++it) (*it)->aside_ends();
}

}  // namespace partrain::events
