// Whether this process is a plan's dry run (`partrain plan`): parameters are made on the meta
// device, collectives are recorded and not run, and the first optimizer step ends the script.
// A flag every layer may read; engine/plan turns it on (plan::set_planning). Layers whose cost
// the planner cannot read off the tensors they leave note here what it needs (their shapes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace partrain::util {

namespace detail {
extern bool planning;
}
/// Whether this process is planning. Inline: every tensor crossing from Lua asks.
inline bool planning() { return detail::planning; }
/// Sets the flag alone; plan::set_planning also installs what planning needs.
void set_planning_flag(bool on);

/// One attention over a sequence split across a context group of more than one rank, as a
/// planned run calls it: q (batch, heads, rows, head_size), k and v (batch, kv_heads, rows,
/// head_size), each rank's rows. The planner predicts from these what either mode (ring,
/// all_to_all) would exchange in a step.
struct ContextAttentionNote {
  int64_t batch = 0, heads = 0, kv_heads = 0, rows = 0, head_size = 0;
  int64_t element_size = 0;  ///< bytes of an element of q, k and v
  int context = 1;           ///< the group's size
  bool ring = true;          ///< the mode it ran (else all_to_all)
  bool backward = false;     ///< a backward will follow (gradients on): its exchanges count too
};
/// Adds a note (planning only; a real run notes nothing).
void note_context_attention(const ContextAttentionNote& note);
/// The notes so far, oldest first.
std::vector<ContextAttentionNote> context_attention_notes();
/// Keeps the first `count` notes (0: none), as the planner's first step begins or a forward set
/// aside ends.
void keep_context_attention_notes(size_t count);

/// One mixture-of-experts forward whose experts are split over an expert group of more than one
/// rank, as a planned run calls it: this rank's `tokens` (N) routed to `top_k` experts each, the
/// `slots` (T) rows of width `dim` that travel (N x top_k, less any capacity drops). The planner
/// routes meta tensors evenly (T/E rows an expert), so what it notes is the balanced exchange.
struct ExpertExchangeNote {
  int64_t experts = 0, top_k = 0, tokens = 0, slots = 0, dim = 0;
  int64_t element_size = 0;  ///< bytes of an element of the rows (the model's dtype)
  int expert = 1;            ///< the expert group's size
  bool backward = false;     ///< a backward will follow (gradients on): its two exchanges count too
};
/// Adds a note (planning only; a real run notes nothing).
void note_expert_exchange(const ExpertExchangeNote& note);
/// The notes so far, oldest first.
std::vector<ExpertExchangeNote> expert_exchange_notes();
/// Keeps the first `count` notes (0: none), as keep_context_attention_notes.
void keep_expert_exchange_notes(size_t count);

}  // namespace partrain::util
