// MoE routing models (DESIGN.md "MoE routing models"): parsed from --imbalance, turned into
// expected per-layer loads for the planner and into realised top-k expert ids for the executor.
//   RoutingModel m = parse_routing_model("hot-expert=0.5,2");   // InputError naming --imbalance
//   RoutingShape shape{/*EP=*/4, /*E=*/16, /*k=*/2};  ExpectedLoads x = expected_loads(m, shape, 1024, 0);
//   double rho = imbalance_rho(received_rows_per_rank(x.copies, shape));
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace flatpeak {

// A count matrix, row-major nested: [EP][E] token copies (source rank × expert) unless stated.
using CountMatrix = std::vector<std::vector<int64_t>>;

// The expert-parallel layout one MoE layer is routed over. Experts are split E/EP per rank:
// expert e lives on rank e / (E/EP). Requires EP ≥ 1, E % EP == 0, 1 ≤ k ≤ E: the functions
// below throw std::invalid_argument otherwise (the caller validates --ep against the model).
struct RoutingShape {
  int64_t ep_ranks = 1;     // EP
  int64_t num_experts = 1;  // E
  int64_t top_k = 1;        // k: each token picks k distinct experts
  int64_t experts_per_rank() const { return num_experts / ep_ranks; }  // L = E/EP
  int64_t rank_of_expert(int64_t expert) const { return expert / experts_per_rank(); }
};

enum class RoutingKind { Balanced, Rho, HotExpert, HotRank, Zipf, File };

// The per-layer matrices of a routing file. JSON format ("file=PATH"):
//   { "flatpeak_routing": 1, "ep_ranks": 2, "num_experts": 4,
//     "layers": [ [[5, 5, 5, 5], [8, 4, 4, 4]],      <- MoE layer 0: EP rows × E columns
//                 [[2, 6, 6, 6], [5, 5, 5, 5]] ] }    <- MoE layer 1
// Entry [s][e] = token copies that source rank s sends to expert e (non-negative integers).
// Only the proportions of each row matter: row s is rescaled to T·k copies for the planner's T
// (so a file recorded at one T applies at another); every row must have a positive sum.
// MoE layer l (counting MoE layers only, from 0) uses layers[l % layers.size()], so a file with
// one matrix applies to every layer; otherwise validate_routing_model requires one matrix per
// MoE layer.
struct RoutingFile {
  std::string path;
  int64_t ep_ranks = 0;
  int64_t num_experts = 0;
  std::vector<CountMatrix> layers;  // [layers][EP][E]
};

// One routing model. Only the fields of `kind` are meaningful.
struct RoutingModel {
  RoutingKind kind = RoutingKind::Balanced;
  double rho = 1.0;           // Rho: X, the busiest rank (rank 0) receives X × the mean rows
  double hot_fraction = 0.0;  // HotExpert, HotRank: f
  int64_t hot_experts = 0;    // HotExpert: h (experts 0..h-1 are hot)
  double zipf_exponent = 0.0; // Zipf: s
  std::string file_path;      // File: PATH as the user gave it
  std::shared_ptr<const RoutingFile> file;  // File: the loaded matrices
};
// Equal kind and equal fields of that kind (File: equal file_path).
bool operator==(const RoutingModel& a, const RoutingModel& b);
inline bool operator!=(const RoutingModel& a, const RoutingModel& b) { return !(a == b); }

// How each model maps to loads. Every model gives, per source rank s, a target share q_s[e] of
// that source's T·k token copies for each expert e (Σ_e q_s[e] = 1):
//   balanced       q[e] = 1/E.
//   rho=X          q[e] = X/E on rank 0's experts, (1 − X/EP)/(E − E/EP) on the others, so rank
//                  0 receives X·T·k rows and every other rank (EP − X)/(EP − 1)·T·k.
//                  X must lie in [1, ρ_max] (an input error otherwise; see rho_max()).
//   hot-expert=f,h q[e] = f/h for e < h, (1 − f)/(E − h) for the others.
//   hot-rank=f     q[e] = f/L on rank 0's L experts, (1 − f)/(E − L) on the others
//                  (hot-rank=f is rho=f·EP).
//   zipf=s         q[e] ∝ 1/(e + 1)^s: expert 0 is the most popular (and lives on rank 0).
//   file=PATH      q_s[e] = row s of the layer's matrix / its row sum.
// Feasibility: a token's k experts are distinct, so an expert receives at most one copy per
// token: q[e] ≤ 1/k (this also bounds a rank's share of each source by min(k, E/EP)/k, i.e. a
// rank receives at most T·min(k, E/EP) copies from each source). A model that asks for more is
// clamped: saturated experts get exactly 1/k and the excess is spread over the others in
// proportion to their shares (evenly where those are all zero); ExpectedLoads says so.
// The shares become integer inclusion weights w_s[e] in units of 2^-30 of a token
// (Σ_e w = k·2^30, each w ≤ 2^30), so the expected copies of e from one source are T·w/2^30.
// Shares use only IEEE + − × ÷ (exact on every platform) except zipf's std::pow, whose last-bit
// differences between math libraries could, rarely, move one unit of 2^-30.
// The hot rank of rho / hot-rank and the hot experts are the same in every layer (a planner's
// worst layer is then any layer); file=PATH is the way to vary routing per layer or per source.

// Parses --imbalance: "balanced", "rho=X", "hot-expert=f,h", "hot-rank=f", "zipf=s",
// "file=PATH" (the file is read and checked here). Throws InputError listing every problem, each
// naming --imbalance, the rule and the value, with the valid forms in the hint.
RoutingModel parse_routing_model(const std::string& text);

// The text form; parse_routing_model(to_string(m)) == m (numbers printed shortest-exact).
std::string to_string(const RoutingModel& model);

// Reads and checks a routing file (format above); InputError names the file and JSON pointer.
RoutingFile load_routing_file(const std::string& path);
RoutingFile parse_routing_file(const std::string& json_text, const std::string& path);

// Checks the model against a valid shape: rho=X ≤ ρ_max; hot-expert h ≤ E; a
// file's ep_ranks and num_experts equal to the shape's and its layer count 1 or num_moe_layers
// (num_moe_layers = 0 skips that check). Throws InputError naming --imbalance.
void validate_routing_model(const RoutingModel& model, const RoutingShape& shape,
                            int64_t num_moe_layers = 0);

// Expected loads of one MoE layer for T = tokens_per_rank tokens on every source rank.
struct ExpectedLoads {
  // [EP][E]: expected token copies, source rank × expert, as exact integers: each row sums to
  // exactly T·k and each entry is ≤ T. Rounding: floor(T·w/2^30) each, then the remaining
  // copies one each to the experts with the largest remainders (ties: lower expert id).
  CountMatrix copies;
  bool clamped = false;    // the model asked for more than distinct top-k routing allows
  std::string clamp_note;  // one sentence for the plan's warnings; empty when not clamped
};
ExpectedLoads expected_loads(const RoutingModel& model, const RoutingShape& shape,
                             int64_t tokens_per_rank, int64_t moe_layer);

// Realised routing for the executor: for each of `tokens` tokens, k distinct expert ids,
// row-major [T, k] (the k ids of a token in the random order they were drawn, not sorted).
// A pure function of (model, shape, seed, rank, moe_layer, token index): identical on every
// platform (integer splitmix64 counter hash; no std:: distributions). `rank` (any rank id)
// seeds the stream; `ep_rank` (0..EP−1) selects the source row of the model (file=PATH and any
// per-source model). Each token draws its experts by systematic sampling over a per-token random
// order of the experts with inclusion weights w[e] (above), so P(token picks e) = w[e]/2^30
// exactly and the realised copies per expert have expectation T·w/2^30. Cost O(T·E).
std::vector<int32_t> generate_routing(const RoutingModel& model, const RoutingShape& shape,
                                      int64_t tokens, uint64_t seed, int64_t rank,
                                      int64_t ep_rank, int64_t moe_layer);

// Per-expert counts [E] of a [T, k] id array (ids must lie in 0..E−1).
std::vector<int64_t> count_routing(const std::vector<int32_t>& expert_ids,
                                   const RoutingShape& shape);
// [EP][E] count matrix from each EP source rank's [T, k] ids (expert_ids_per_rank.size() == EP).
CountMatrix count_matrix(const std::vector<std::vector<int32_t>>& expert_ids_per_rank,
                         const RoutingShape& shape);

// Global per-expert loads [E] (column sums of an [EP][E] matrix): LLA's input l_e.
std::vector<int64_t> expert_loads(const CountMatrix& copies);
// Rows each destination rank receives [EP] under standard EP (no LLEP): Σ over sources and over
// the rank's own E/EP experts.
std::vector<int64_t> received_rows_per_rank(const CountMatrix& copies, const RoutingShape& shape);
// ρ = max / mean of per-rank rows; 1.0 when all are zero.
double imbalance_rho(const std::vector<int64_t>& rows_per_rank);
// Worst case of dropless routing: ρ_max = EP·min(k, E/EP)/k.
double rho_max(const RoutingShape& shape);

}  // namespace flatpeak
