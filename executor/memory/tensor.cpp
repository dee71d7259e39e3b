#include "executor/memory/tensor.h"

#include <limits>
#include <stdexcept>
#include <utility>

namespace flatpeak::exec {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
  }
  return "?";
}

Tensor::Tensor(TrackingAllocator& allocator, DType dtype, std::vector<int64_t> shape,
               Category category, MemorySpace space)
    : allocator_(&allocator), dtype_(dtype), shape_(std::move(shape)), numel_(1) {
  for (int64_t d : shape_) {
    if (d < 0) throw std::invalid_argument("tensor dimension must be >= 0 (got " +
                                           std::to_string(d) + ")");
    if (d != 0 && numel_ > std::numeric_limits<int64_t>::max() / 8 / d) {
      throw std::invalid_argument("tensor size overflows int64 bytes");
    }
    numel_ *= d;
  }
  allocation_ = allocator.allocate(numel_ * dtype_bytes(dtype), category, space);
}

Tensor::Tensor(Tensor&& other) noexcept
    : allocator_(std::exchange(other.allocator_, nullptr)),
      allocation_(std::exchange(other.allocation_, Allocation{})),
      dtype_(other.dtype_),
      shape_(std::move(other.shape_)),
      numel_(std::exchange(other.numel_, 0)) {}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  if (this != &other) {
    reset();
    allocator_ = std::exchange(other.allocator_, nullptr);
    allocation_ = std::exchange(other.allocation_, Allocation{});
    dtype_ = other.dtype_;
    shape_ = std::move(other.shape_);
    numel_ = std::exchange(other.numel_, 0);
  }
  return *this;
}

void Tensor::reset() {
  if (allocator_ != nullptr) allocator_->release(allocation_);
  allocator_ = nullptr;
  allocation_ = Allocation{};
  shape_.clear();
  numel_ = 0;
}

void Tensor::set_category(Category category) {
  if (allocator_ != nullptr) allocator_->retag(allocation_, category);
  else allocation_.category = category;
}

void Tensor::check_dtype(DType requested) const {
  if (requested != dtype_) {
    throw std::logic_error(std::string("tensor holds ") + dtype_name(dtype_) + ", accessed as " +
                           dtype_name(requested));
  }
}

}  // namespace flatpeak::exec
