#include "executor/comm/communicator.h"

#include <algorithm>
#include <cstdlib>
#include <exception>

#include "spec/errors.h"

namespace flatpeak::exec {

RankFailed::RankFailed(int failing_rank_, int exit_code_, const std::string& message_)
    : std::runtime_error("rank " + std::to_string(failing_rank_) + " failed: " + message_),
      failing_rank(failing_rank_),
      exit_code(exit_code_),
      reason(message_) {}

CommError::CommError(int rank, const std::string& operation, const std::string& message)
    : std::runtime_error("rank " + std::to_string(rank) + ": " + operation + ": " + message) {}

namespace {

template <class T, class Acc>
void reduce_typed(const std::vector<const void*>& in, void* out, int64_t count, ReduceOp op) {
  T* dst = static_cast<T*>(out);
  for (int64_t i = 0; i < count; ++i) {
    Acc acc = static_cast<Acc>(static_cast<const T*>(in[0])[i]);
    for (size_t p = 1; p < in.size(); ++p) {
      const Acc v = static_cast<Acc>(static_cast<const T*>(in[p])[i]);
      acc = op == ReduceOp::Sum ? static_cast<Acc>(acc + v) : std::max(acc, v);
    }
    dst[i] = static_cast<T>(acc);
  }
}

void reduce_bf16(const std::vector<const void*>& in, void* out, int64_t count, ReduceOp op) {
  Bf16* dst = static_cast<Bf16*>(out);
  for (int64_t i = 0; i < count; ++i) {
    float acc = to_f32(static_cast<const Bf16*>(in[0])[i]);
    for (size_t p = 1; p < in.size(); ++p) {
      const float v = to_f32(static_cast<const Bf16*>(in[p])[i]);
      acc = op == ReduceOp::Sum ? acc + v : std::max(acc, v);
    }
    dst[i] = f32_to_bf16(acc);
  }
}

}  // namespace

void reduce_in_rank_order(const std::vector<const void*>& contributions, void* out,
                          int64_t count, DType dtype, ReduceOp op) {
  if (contributions.empty() || count <= 0) return;
  // Read every contribution before writing: out may alias contributions[p] (in-place
  // all_reduce), so reduce element by element (each element is read before it is written).
  switch (dtype) {
    case DType::F32: reduce_typed<float, float>(contributions, out, count, op); break;
    case DType::BF16: reduce_bf16(contributions, out, count, op); break;
    case DType::I32: reduce_typed<int32_t, int64_t>(contributions, out, count, op); break;
    case DType::I64: reduce_typed<int64_t, int64_t>(contributions, out, count, op); break;
  }
}

std::string detect_launcher() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') return "mpi";
  }
  return "threads";
}

int exit_code_for_current_exception() {
  try {
    throw;
  } catch (const RankFailed& e) {
    return e.exit_code;
  } catch (const InputError&) {
    return kExitInputError;
  } catch (...) {
    return kExitRuntimeError;
  }
}

}  // namespace flatpeak::exec
