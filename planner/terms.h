// Memory terms: one sized tensor (or `count` equal tensors) of the per-GPU memory model, with its
// shape in DESIGN.md's symbols and the category and space it is counted under.
//   TermList t(alignment_bytes);
//   t.add("logits", {{"T", T}, {"V", V}}, kBf16, Category::Vocab);   // "[T=..., V=...] bf16"
//   int64_t vocab_bytes = t.bytes(Category::Vocab);
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace flatpeak::planner {

// Element types and their sizes in bytes.
struct Dtype {
  const char* name;
  int64_t bytes;
};
inline constexpr Dtype kBf16{"bf16", 2};
inline constexpr Dtype kFp32{"fp32", 4};
inline constexpr Dtype kInt64{"int64", 8};
inline constexpr Dtype kBool{"bool", 1};

// What a term is, for the timeline's per-category sums and for the five peaks' components.
enum class Category {
  Params,           // parameter shards (fp32 master in the baseline, bf16 with optimizer offload)
  Grads,            // gradient shards
  Optimizer,        // Adam m, v (and the fp32 master when it is not the param shard); staging
  Fsdp,             // gathered units, prefetch, unsharded grads, reduce-scatter inputs
  Boundaries,       // checkpoint boundaries ([T, H] bf16 layer inputs) and their offload buffers
  Activations,      // the layer working set: attention, norms, dense FFN, residual grads, embedding
  Dispatch,         // routing, dispatch/combine buffers, expert activations, foreign weights
  Vocab,            // final hidden X, LM head W, logits, loss state, dX, dW
};
inline constexpr int kCategoryCount = 8;
const char* to_string(Category category);

enum class Space { Device, Host };

// One dimension of a shape: its symbol in DESIGN.md and its value.
struct Dim {
  const char* symbol;
  int64_t value;
};

struct Term {
  std::string name;   // "logits"
  std::string shape;  // "[T=1048576, V=201088] bf16"
  int64_t count = 1;  // equal tensors counted together (e.g. 36 boundaries)
  int64_t bytes = 0;  // count × aligned bytes of one tensor
  Category category = Category::Activations;
  Space space = Space::Device;
};

// Checked int64 arithmetic: throws InputError (naming --context, the quantity that drives sizes)
// when a product or sum would overflow, instead of wrapping.
int64_t checked_mul(int64_t a, int64_t b);
int64_t checked_add(int64_t a, int64_t b);
int64_t ceil_div(int64_t a, int64_t b);
// Rounds up to a multiple of alignment (alignment ≤ 1: unchanged).
int64_t align_up(int64_t bytes, int64_t alignment);

class TermList {
 public:
  explicit TermList(int64_t alignment_bytes = 1) : alignment_bytes_(alignment_bytes) {}

  // Adds `count` tensors of the given dims and dtype. Zero-sized or zero-count terms are skipped.
  void add(const std::string& name, std::initializer_list<Dim> dims, Dtype dtype, Category category,
           int64_t count = 1, Space space = Space::Device);
  // Adds a term whose size is a number of elements without a tensor shape of its own (a flat
  // shard, a bucket): shape is "[<label>=elems] dtype".
  void add_flat(const std::string& name, const char* label, int64_t elems, Dtype dtype, Category category,
                int64_t count = 1, Space space = Space::Device);
  // Adds one term of a given size (a set of tensors aligned one by one, described by `shape`).
  void add_sized(const std::string& name, const std::string& shape, int64_t bytes, Category category,
                 Space space = Space::Device);
  void append(const TermList& other);

  const std::vector<Term>& terms() const { return terms_; }
  int64_t bytes(Space space) const;
  int64_t bytes(Category category, Space space = Space::Device) const;
  int64_t alignment_bytes() const { return alignment_bytes_; }

 private:
  int64_t alignment_bytes_;
  std::vector<Term> terms_;
};

}  // namespace flatpeak::planner
