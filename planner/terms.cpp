#include "terms.h"

#include <fmt/format.h>

#include "spec/errors.h"

namespace flatpeak::planner {

const char* to_string(Category category) {
  switch (category) {
    case Category::Params: return "params";
    case Category::Grads: return "grads";
    case Category::Optimizer: return "optimizer";
    case Category::Fsdp: return "fsdp";
    case Category::Boundaries: return "boundaries";
    case Category::Activations: return "activations";
    case Category::Dispatch: return "dispatch";
    case Category::Vocab: return "vocab";
  }
  return "activations";
}

namespace {
[[noreturn]] void overflow() {
  throw InputError(Diagnostic{"", "--context",
                              "the memory model's sizes overflow a 64-bit byte count at this context and batch",
                              "use a smaller --context or --micro-batch"});
}
}  // namespace

int64_t checked_mul(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) overflow();
  return r;
}

int64_t checked_add(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) overflow();
  return r;
}

int64_t ceil_div(int64_t a, int64_t b) { return b <= 0 ? 0 : (a + b - 1) / b; }

int64_t align_up(int64_t bytes, int64_t alignment) {
  if (alignment <= 1 || bytes <= 0) return bytes;
  return checked_mul(ceil_div(bytes, alignment), alignment);
}

void TermList::add(const std::string& name, std::initializer_list<Dim> dims, Dtype dtype, Category category,
                   int64_t count, Space space) {
  int64_t elems = 1;
  for (const Dim& dim : dims) elems = checked_mul(elems, dim.value);
  if (elems <= 0 || count <= 0) return;
  std::string shape;
  shape.reserve(48);
  shape += '[';
  bool first = true;
  for (const Dim& dim : dims) {
    if (!first) shape += ", ";
    shape += dim.symbol;
    shape += '=';
    shape += std::to_string(dim.value);
    first = false;
  }
  shape += "] ";
  shape += dtype.name;
  const int64_t one = align_up(checked_mul(elems, dtype.bytes), alignment_bytes_);  // host tensors too (the executor's allocator)
  terms_.push_back(Term{name, shape, count, checked_mul(count, one), category, space});
}

void TermList::add_flat(const std::string& name, const char* label, int64_t elems, Dtype dtype,
                        Category category, int64_t count, Space space) {
  add(name, {{label, elems}}, dtype, category, count, space);
}

void TermList::add_sized(const std::string& name, const std::string& shape, int64_t bytes, Category category, Space space) {
  if (bytes <= 0) return;
  terms_.push_back(Term{name, shape, 1, bytes, category, space});
}

void TermList::append(const TermList& other) {
  terms_.insert(terms_.end(), other.terms_.begin(), other.terms_.end());
}

int64_t TermList::bytes(Space space) const {
  int64_t sum = 0;
  for (const auto& t : terms_)
    if (t.space == space) sum = checked_add(sum, t.bytes);
  return sum;
}

int64_t TermList::bytes(Category category, Space space) const {
  int64_t sum = 0;
  for (const auto& t : terms_)
    if (t.space == space && t.category == category) sum = checked_add(sum, t.bytes);
  return sum;
}

}  // namespace flatpeak::planner
