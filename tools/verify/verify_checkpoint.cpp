// verify --component checkpoint: an L-layer checkpointed stack with selective checkpoint offload (SCO) of the boundaries.
// Not yet run by this build: verify_components() leaves it out, so --component checkpoint is refused
// with exit 2 before anything runs.
#include <stdexcept>

#include "verify_common.h"

namespace flatpeak::cli {

void verify_checkpoint(const VerifyContext&, VerifyReport&) {
  throw std::logic_error("verify: the checkpoint component is not implemented yet");
}

}  // namespace flatpeak::cli
