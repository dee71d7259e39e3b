// The predicted per-GPU memory timeline of one training step: phases in execution order, each
// with its full live set (persistent state + that phase's transients). Names follow the grammar
// of traces/README.md; repeated phases are folded into the instance with the most live memory.
//   Timeline tl = build_timeline(Context{model, run, work});
//   for (const Phase& p : tl.phases) p.terms.bytes(Space::Device);
#pragma once

#include <string>
#include <vector>

#include "memory_model.h"

namespace flatpeak::planner {

struct Phase {
  std::string name;   // "bwd/L35/moe/experts"
  std::string folds;  // the phases this one stands for, e.g. "L0-L35" or "r0-r15"; "" = itself
  TermList terms;     // device terms (host memory is constant over the step: Timeline::host)
  int64_t device_bytes() const { return terms.bytes(Space::Device); }
};

struct Timeline {
  std::vector<Phase> phases;
  TermList host_per_gpu;  // pinned host memory of one GPU's process, allocated for the whole step
};

// fold = false lists every layer (for tests of the folding rule; plans always fold).
Timeline build_timeline(const Context& c, bool fold = true);

}  // namespace flatpeak::planner
