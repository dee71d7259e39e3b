// Injected failures under mpirun, for tests/mpi/expect_exit.sh:
//   failure_inject throw   rank 2 throws std::runtime_error -> job exits 4 (rank 2 aborts)
//   failure_inject input   rank 1 throws InputError         -> job exits 2
//   failure_inject status  rank 3 reports 2 at a checkpoint -> every rank returns 2 (agreed)
//   failure_inject hang    rank 2 stops answering           -> a peer's watchdog aborts with 4
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>

#include "executor/comm/mpi_comm.h"
#include "spec/errors.h"

using namespace flatpeak;
using namespace flatpeak::exec;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  MpiCommunicator comm(MpiOptions{/*peer_timeout_s=*/3.0});
  const RankStatus status = run_mpi_rank(comm, [&](int rank, Communicator& c) {
    c.barrier();
    if (mode == "throw" && rank == 2) throw std::runtime_error("injected failure");
    if (mode == "input" && rank == 1) {
      throw InputError(Diagnostic{"plan.json", "/knobs/ep", "injected bad input", ""});
    }
    if (mode == "hang" && rank == 2) std::this_thread::sleep_for(std::chrono::seconds(120));
    c.check_status(mode == "status" && rank == 3 ? kExitInputError : 0, "injected status");
    for (int i = 0; i < 3; ++i) c.barrier();
  });
  if (!status.ok && comm.rank() == 0) std::fprintf(stderr, "flatpeak: error: %s\n", status.message.c_str());
  return status.exit_code;
}
