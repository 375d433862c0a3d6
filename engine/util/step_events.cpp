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
template <class Fn>
void announce(Fn fn) {
  for (auto* o : observers()) fn(*o);
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
  // In reverse: an observer added during the aside never saw it begin.
  auto& all = observers();
  for (auto it = all.rbegin(); it != all.rend(); ++it) (*it)->aside_ends();
}

}  // namespace partrain::events
