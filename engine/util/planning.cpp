// The planning flag and what layers note for the planner (planning.hpp).
#include "engine/util/planning.hpp"

#include <cstddef>
#include <mutex>

namespace partrain::util {

namespace detail {
bool planning = false;
}

void set_planning_flag(bool on) { detail::planning = on; }

namespace {
std::mutex notes_mutex;
std::vector<ContextAttentionNote> notes;
std::vector<ExpertExchangeNote> expert_notes;
}  // namespace

void note_context_attention(const ContextAttentionNote& note) {
  std::lock_guard<std::mutex> lock(notes_mutex);
  notes.push_back(note);
}

std::vector<ContextAttentionNote> context_attention_notes() {
  std::lock_guard<std::mutex> lock(notes_mutex);
  return notes;
}

void keep_context_attention_notes(size_t count) {
  std::lock_guard<std::mutex> lock(notes_mutex);
  if (count < notes.size()) notes.resize(count);
}

void note_expert_exchange(const ExpertExchangeNote& note) {
  std::lock_guard<std::mutex> lock(notes_mutex);
  expert_notes.push_back(note);
}

std::vector<ExpertExchangeNote> expert_exchange_notes() {
  std::lock_guard<std::mutex> lock(notes_mutex);
  return expert_notes;
}

void keep_expert_exchange_notes(size_t count) {
  std::lock_guard<std::mutex> lock(notes_mutex);
  if (count < expert_notes.size()) expert_notes.resize(count);
}

}  // namespace partrain::util
