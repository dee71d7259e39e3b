// verify --component dispatch: one MoE layer's dispatch, experts and combine, forward and backward, split into capped rounds.
// Not yet run by this build: verify_components() leaves it out, so --component dispatch is refused
// with exit 2 before anything runs.
#include <stdexcept>

#include "verify_common.h"

namespace flatpeak::cli {

void verify_dispatch(const VerifyContext&, VerifyReport&) {
  throw std::logic_error("verify: the dispatch component is not implemented yet");
}

}  // namespace flatpeak::cli
