// A move-only buffer with a dtype and shape whose storage comes only from a TrackingAllocator;
// released when it goes out of scope (or on reset()).
//   Tensor x(alloc, DType::BF16, {T, H}, Category::Boundaries, MemorySpace::Host);  // [T, H] bf16
//   Bf16* p = x.data<Bf16>();   x.bytes() == T * H * 2
//   x.reset();                  // frees early; the allocator's live bytes drop at once
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "executor/memory/tracking_allocator.h"
#include "executor/ops/dtype.h"

namespace flatpeak::exec {

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() { return DType::F32; }
template <>
constexpr DType dtype_of<Bf16>() { return DType::BF16; }
template <>
constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <>
constexpr DType dtype_of<int64_t>() { return DType::I64; }

class Tensor {
 public:
  Tensor() = default;
  // Shape dims must be >= 0; an empty tensor (a zero dim) holds a null pointer on purpose.
  Tensor(TrackingAllocator& allocator, DType dtype, std::vector<int64_t> shape, Category category,
         MemorySpace space = MemorySpace::Device);
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  Tensor(Tensor&& other) noexcept;
  Tensor& operator=(Tensor&& other) noexcept;
  ~Tensor() { reset(); }

  void reset();
  // The buffer's role changed (TrackingAllocator::retag): same storage, another category.
  void set_category(Category category);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim(size_t i) const { return shape_.at(i); }
  int64_t numel() const { return numel_; }
  int64_t bytes() const { return allocation_.requested_bytes; }  // numel * dtype size
  int64_t tracked_bytes() const { return allocation_.tracked_bytes; }
  Category category() const { return allocation_.category; }
  MemorySpace space() const { return allocation_.space; }
  bool empty() const { return allocation_.data == nullptr; }

  void* raw() { return allocation_.data; }
  const void* raw() const { return allocation_.data; }
  // Typed access; throws std::logic_error when T does not match dtype().
  template <class T>
  T* data() {
    check_dtype(dtype_of<T>());
    return static_cast<T*>(allocation_.data);
  }
  template <class T>
  const T* data() const {
    check_dtype(dtype_of<T>());
    return static_cast<const T*>(allocation_.data);
  }

 private:
  void check_dtype(DType requested) const;

  TrackingAllocator* allocator_ = nullptr;
  Allocation allocation_;
  DType dtype_ = DType::F32;
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
};

}  // namespace flatpeak::exec
