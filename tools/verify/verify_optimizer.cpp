// verify --component optimizer: one optimizer step: on the device, serial offload, or OffloadStreamAdamW.
// Not yet run by this build: verify_components() leaves it out, so --component optimizer is refused
// with exit 2 before anything runs.
#include <stdexcept>

#include "verify_common.h"

namespace flatpeak::cli {

void verify_optimizer(const VerifyContext&, VerifyReport&) {
  throw std::logic_error("verify: the optimizer component is not implemented yet");
}

}  // namespace flatpeak::cli
