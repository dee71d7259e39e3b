// The process exit codes of `flatpeak` (DESIGN.md, "Exit codes"). Only main() returns them.
#pragma once

namespace flatpeak::cli {

enum ExitCode : int {
  kExitOk = 0,              // a plan that fits; a verified run; an answer computed
  kExitInternal = 1,        // a bug: an unexpected exception
  kExitInput = 2,           // usage or input error
  kExitDoesNotFit = 3,      // plan computed but does not fit (still printed)
  kExitBackend = 4,         // backend or runtime failure (CUDA, NCCL, MPI, device OOM)
  kExitVerifyMismatch = 5,  // verification mismatch beyond tolerance
};

}  // namespace flatpeak::cli
