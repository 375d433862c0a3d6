// The phases of a training step, announced to whoever listens: the planner notes the first
// step's memory and traffic, the tracer records a step's spans. The code that trains announces
// the phases and measures nothing itself; nothing it includes knows who listens.
#pragma once

#include <string>

namespace partrain::events {

/// Who listens to the training step's phases; every method does nothing unless overridden.
/// Observers are called on the thread that trains, in the order they were added.
class StepObserver {
 public:
  virtual ~StepObserver() = default;
  /// A train_step begins (ParallelModel's, a pipeline's), on every rank of the model.
  virtual void train_step_begins() {}
  /// ... and ends; `row` names this rank's part of it ("rank 1: pipeline rank 1").
  virtual void train_step_ends(const std::string& row) { (void)row; }
  /// A training forward begins: a train_step's micro-batch, or a script's own forward of a
  /// module in training mode.
  virtual void forward_begins() {}
  /// Its forward is done (a loss's backward is next): what it left allocated is its activations.
  virtual void forward_ends() {}
  /// A forward that is not training begins (the policy probe, the stage timing): an observer
  /// keeps its record aside and puts it back at aside_ends, so that the forward counts for
  /// nothing. Asides nest.
  virtual void aside_begins() {}
  virtual void aside_ends() {}
};

/// Adds an observer for the process's life (it must outlive every step).
void observe(StepObserver* observer);
/// Removes one (nothing when it was not added).
void unobserve(StepObserver* observer);

void train_step_begins();
void train_step_ends(const std::string& row);
void forward_begins();
void forward_ends();

/// A forward that is not training, for the scope of this object (aside_begins/aside_ends).
class Aside {
 public:
  Aside();
  ~Aside();
  Aside(const Aside&) = delete;
  Aside& operator=(const Aside&) = delete;
};

}  // namespace partrain::events
