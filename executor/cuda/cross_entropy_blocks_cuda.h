// The per-block steps of the blocked cross-entropy on the GPU (cross_entropy_cuda.cu), for
// schedules that fold logits blocks of their own (Ring-DTP: a token's online state crosses the
// shards of a ring). Every pointer is a device pointer; every launch is on `stream`. Columns of a
// block are vocabulary rows [first_col, first_col + cols); `targets` are global vocabulary ids.
//   init_online_rows_cuda(row_max, row_sum, target_logit, rows, s);
//   fold_logits_block_cuda(logits, rows, cols, v0, targets, row_max, row_sum, target_logit, s);
//   finish_online_rows_cuda(row_max, row_sum, target_logit, targets, lse, loss, rows, s);
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "executor/ops/dtype.h"

namespace flatpeak::exec::cuda_detail {

// row_max = −inf, row_sum = 0, target_logit = 0 for `rows` rows.
void init_online_rows_cuda(float* row_max, float* row_sum, float* target_logit, int64_t rows, cudaStream_t stream);

// Folds an fp32 logits block [rows, cols] into each row's running (max, sum) with lse_fold, and
// takes the target's logit where the target falls in the block's columns.
void fold_logits_block_cuda(const float* logits, int64_t rows, int64_t cols, int64_t first_col, const int32_t* targets,
                            float* row_max, float* row_sum, float* target_logit, cudaStream_t stream);

// lse = max + log(sum); loss = lse − target logit (0 for an ignored target < 0).
void finish_online_rows_cuda(const float* row_max, const float* row_sum, const float* target_logit, const int32_t* targets,
                             float* lse, float* loss, int64_t rows, cudaStream_t stream);

// dz = g · (e^(z − lse) − onehot) of an fp32 logits block [rows, cols], 0 for an ignored target,
// rounded once into the bf16 block dz [rows, cols].
void dlogits_block_bf16_cuda(const float* logits, Bf16* dz, int64_t rows, int64_t cols, int64_t first_col,
                             const int32_t* targets, const float* lse, float grad_scale, cudaStream_t stream);

}  // namespace flatpeak::exec::cuda_detail
