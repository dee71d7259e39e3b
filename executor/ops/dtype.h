// Storage types of executor buffers and the per-element conversions both backends share.
//   Bf16 b = f32_to_bf16(1.5f);        // round to nearest even, 2 bytes in memory
//   float x = to_f32(b);               // exact widening; compute is always fp32
//   store_f32(&b, 2.25f);              // overloads for float and Bf16 let kernels be templates
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FLATPEAK_HD __host__ __device__
#else
#define FLATPEAK_HD
#endif

namespace flatpeak::exec {

// What a buffer holds. Compute tensors are F32 or BF16; indices I32/I64.
enum class DType : uint8_t { F32, BF16, I32, I64 };

constexpr int64_t dtype_bytes(DType dtype) {
  return dtype == DType::BF16 ? 2 : (dtype == DType::I64 ? 8 : 4);
}
const char* dtype_name(DType dtype);

// bfloat16 stored as its 16 raw bits (the upper half of an IEEE fp32). A distinct type, so that
// kernels can be templates over float/Bf16 storage and overloads pick the conversion.
struct Bf16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == 2, "a bf16 element occupies 2 bytes");

FLATPEAK_HD inline uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

FLATPEAK_HD inline float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// Round to nearest, ties to even; NaN stays NaN (quiet), infinities stay infinite.
FLATPEAK_HD inline Bf16 f32_to_bf16(float x) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return Bf16{static_cast<uint16_t>((u + rounding) >> 16)};
}

FLATPEAK_HD inline float to_f32(Bf16 x) { return f32_from_bits(static_cast<uint32_t>(x.bits) << 16); }
FLATPEAK_HD inline float to_f32(float x) { return x; }

FLATPEAK_HD inline void store_f32(float* dst, float x) { *dst = x; }
FLATPEAK_HD inline void store_f32(Bf16* dst, float x) { *dst = f32_to_bf16(x); }

// The value x has after a round trip through storage type T (x itself for float).
FLATPEAK_HD inline float round_to(float x, const float*) { return x; }
FLATPEAK_HD inline float round_to(float x, const Bf16*) { return to_f32(f32_to_bf16(x)); }

}  // namespace flatpeak::exec
