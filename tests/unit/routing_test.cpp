// Routing models: parsing and its error texts, exact expected loads for tiny shapes (derived by
// hand in the comments), the deterministic generator and its convergence to the expected loads.
#include "spec/routing.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "spec/errors.h"

namespace flatpeak {
namespace {

const char* kForms =
    "valid forms: balanced, rho=X (1 <= X <= EP*min(k,E/EP)/k), hot-expert=f,h (0 <= f <= 1, "
    "1 <= h <= E), hot-rank=f (0 <= f <= 1), zipf=s (s >= 0), file=PATH";

std::vector<Diagnostic> parse_errors(const std::string& text) {
  try {
    parse_routing_model(text);
  } catch (const InputError& e) {
    return e.diagnostics();
  }
  ADD_FAILURE() << "no InputError for " << text;
  return {};
}

std::string write_temp(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << text;
  return path;
}

TEST(RoutingParse, EveryFormAndRoundTrip) {
  EXPECT_EQ(parse_routing_model("balanced").kind, RoutingKind::Balanced);
  const RoutingModel rho = parse_routing_model("rho=2.5");
  EXPECT_EQ(rho.kind, RoutingKind::Rho);
  EXPECT_DOUBLE_EQ(rho.rho, 2.5);
  const RoutingModel hot = parse_routing_model("hot-expert=0.30,16");
  EXPECT_EQ(hot.kind, RoutingKind::HotExpert);
  EXPECT_DOUBLE_EQ(hot.hot_fraction, 0.3);
  EXPECT_EQ(hot.hot_experts, 16);
  EXPECT_EQ(to_string(hot), "hot-expert=0.3,16");
  EXPECT_DOUBLE_EQ(parse_routing_model("hot-rank=0.5").hot_fraction, 0.5);
  EXPECT_DOUBLE_EQ(parse_routing_model("zipf=1.2").zipf_exponent, 1.2);
  for (const char* text : {"balanced", "rho=2.5", "rho=1", "hot-expert=0.3,16", "hot-rank=0.75",
                           "zipf=0", "zipf=1.2", "rho=1.0000000000000002"}) {
    const RoutingModel m = parse_routing_model(text);
    EXPECT_EQ(parse_routing_model(to_string(m)), m) << text;
  }
  EXPECT_EQ(to_string(parse_routing_model("rho=1.0000000000000002")), "rho=1.0000000000000002");
  EXPECT_NE(parse_routing_model("rho=2"), parse_routing_model("rho=3"));
}

TEST(RoutingParse, ErrorTextsNameTheFlagRuleAndValue) {
  auto one = [](const std::string& text) {
    const auto d = parse_errors(text);
    EXPECT_EQ(d.size(), 1u) << text;
    return d.empty() ? Diagnostic{} : d[0];
  };
  Diagnostic d = one("rho=0.5");
  EXPECT_EQ(d.file, "");
  EXPECT_EQ(d.pointer, "--imbalance");
  EXPECT_EQ(d.message, "rho=X needs X >= 1 (got 0.5)");
  EXPECT_EQ(d.hint, kForms);
  EXPECT_EQ(d.to_string(), "--imbalance: rho=X needs X >= 1 (got 0.5)");
  EXPECT_EQ(one("rho").message, "rho needs a value, as rho=X (got \"rho\")");
  EXPECT_EQ(one("rho=abc").message, "rho=X needs a number X (got \"rho=abc\")");
  EXPECT_EQ(one("rho=nan").message, "rho=X needs a number X (got \"rho=nan\")");
  EXPECT_EQ(one("balanced=1").message, "balanced takes no value (got \"balanced=1\")");
  EXPECT_EQ(one("hot-expert=0.5").message, "hot-expert=f,h needs two values f,h (got \"hot-expert=0.5\")");
  EXPECT_EQ(one("hot-rank=2").message, "hot-rank=f needs 0 <= f <= 1 (got 2)");
  EXPECT_EQ(one("zipf=-1").message, "zipf=s needs a number s >= 0 (got -1)");
  EXPECT_EQ(one("file=").message, "file=PATH needs a path (got \"file=\")");
  d = one("zipff=1");
  EXPECT_EQ(d.message, "unknown routing model (got \"zipff=1\")");
  EXPECT_EQ(d.hint, std::string("did you mean \"zipf\"? ") + kForms);
  EXPECT_EQ(one("uniform").hint, kForms);

  // Both halves of hot-expert are checked in one pass.
  const auto both = parse_errors("hot-expert=1.5,0");
  ASSERT_EQ(both.size(), 2u);
  EXPECT_EQ(both[0].message, "hot-expert=f,h needs 0 <= f <= 1 (got 1.5)");
  EXPECT_EQ(both[1].message, "hot-expert=f,h needs an integer h >= 1 (got 0)");

  const auto missing = parse_errors("file=/nonexistent/routing.json");
  ASSERT_EQ(missing.size(), 1u);
  EXPECT_EQ(missing[0].file, "/nonexistent/routing.json");
  EXPECT_EQ(missing[0].message, "cannot open file for reading");
}

TEST(RoutingValidate, RhoRangeAndHotExpertCount) {
  const RoutingShape shape{4, 16, 2};  // L = 4 ≥ k: ρ_max = EP = 4
  EXPECT_NO_THROW(validate_routing_model(parse_routing_model("rho=4"), shape));
  try {
    validate_routing_model(parse_routing_model("rho=5"), shape);
    FAIL() << "rho=5 accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()),
              "--imbalance: rho=X needs X <= EP*min(k,E/EP)/k = 4 at EP=4, E=16, k=2 (got 5)");
  }
  try {
    validate_routing_model(parse_routing_model("hot-expert=0.5,17"), shape);
    FAIL() << "h > E accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()), "--imbalance: hot-expert=f,h needs h <= E = 16 (got 17)");
  }
  EXPECT_THROW(validate_routing_model(RoutingModel{}, RoutingShape{3, 16, 2}), std::invalid_argument);
}

TEST(RoutingDerived, RhoMaxReceivedRowsAndRho) {
  EXPECT_DOUBLE_EQ(rho_max(RoutingShape{4, 8, 2}), 4.0);     // L = 2 = k
  EXPECT_DOUBLE_EQ(rho_max(RoutingShape{4, 4, 2}), 2.0);     // L = 1 < k: 4·1/2
  EXPECT_DOUBLE_EQ(rho_max(RoutingShape{8, 256, 8}), 8.0);   // DeepSeek-V3 at EP = 8
  EXPECT_DOUBLE_EQ(rho_max(RoutingShape{8, 16, 4}), 4.0);    // L = 2 < k = 4: 8·2/4
  const CountMatrix copies = {{8, 8, 2, 2}, {9, 9, 3, 3}};
  EXPECT_EQ(expert_loads(copies), (std::vector<int64_t>{17, 17, 5, 5}));
  EXPECT_EQ(received_rows_per_rank(copies, RoutingShape{2, 4, 2}), (std::vector<int64_t>{34, 10}));
  EXPECT_DOUBLE_EQ(imbalance_rho({34, 10}), 34.0 / 22.0);
  EXPECT_DOUBLE_EQ(imbalance_rho({0, 0}), 1.0);
}

// EP = 2, E = 4 (L = 2), k = 2: every source sends T·k copies.
TEST(ExpectedLoads, BalancedAndRhoExact) {
  const RoutingShape shape{2, 4, 2};
  ExpectedLoads x = expected_loads(parse_routing_model("balanced"), shape, 10, 0);
  EXPECT_EQ(x.copies, (CountMatrix{{5, 5, 5, 5}, {5, 5, 5, 5}}));  // 20 copies / 4
  EXPECT_FALSE(x.clamped);

  // rho=1.5: rank 0's share 1.5/2 = 0.75, 0.375 per expert; others 0.125. T = 12: 9, 9, 3, 3.
  x = expected_loads(parse_routing_model("rho=1.5"), shape, 12, 0);
  EXPECT_EQ(x.copies, (CountMatrix{{9, 9, 3, 3}, {9, 9, 3, 3}}));
  EXPECT_DOUBLE_EQ(imbalance_rho(received_rows_per_rank(x.copies, shape)), 1.5);
  // T = 10: 7.5, 7.5, 2.5, 2.5 → floors 18, the 2 left go to equal remainders by lower id.
  x = expected_loads(parse_routing_model("rho=1.5"), shape, 10, 0);
  EXPECT_EQ(x.copies, (CountMatrix{{8, 8, 2, 2}, {8, 8, 2, 2}}));
  // rho=ρ_max=2: every token puts both copies on rank 0, at most one per expert.
  x = expected_loads(parse_routing_model("rho=2"), shape, 10, 0);
  EXPECT_EQ(x.copies, (CountMatrix{{10, 10, 0, 0}, {10, 10, 0, 0}}));
  EXPECT_FALSE(x.clamped);
  // hot-rank=f is rho=f·EP.
  x = expected_loads(parse_routing_model("hot-rank=0.75"), shape, 12, 3);
  EXPECT_EQ(x.copies, (CountMatrix{{9, 9, 3, 3}, {9, 9, 3, 3}}));
}

TEST(ExpectedLoads, HotExpertZipfAndClamping) {
  const RoutingShape shape{2, 4, 2};
  // hot-expert=0.5,2: 0.25 per hot expert, 0.25 per cold one: balanced.
  ExpectedLoads x = expected_loads(parse_routing_model("hot-expert=0.5,2"), shape, 10, 0);
  EXPECT_EQ(x.copies[0], (std::vector<int64_t>{5, 5, 5, 5}));
  // hot-expert=0.6,1 asks expert 0 for 0.6 > 1/k = 0.5 of the copies: clamped to one copy per
  // token (10); the other 10 copies split evenly, 3.33 each: units ⌊2^30/3⌋ + the one unit left
  // to expert 1 (ties by lower id), so expert 1 has the largest remainder: 10, 4, 3, 3.
  x = expected_loads(parse_routing_model("hot-expert=0.6,1"), shape, 10, 0);
  EXPECT_EQ(x.copies, (CountMatrix{{10, 4, 3, 3}, {10, 4, 3, 3}}));
  EXPECT_TRUE(x.clamped);
  EXPECT_EQ(x.clamp_note,
            "--imbalance hot-expert=0.6,1: 1 expert(s) would receive more than one copy per token "
            "(largest share 0.6 of a source's copies > 1/k = 0.5); clamped to one copy per token, "
            "the excess spread over the other experts");
  // zipf=1: shares 1, 1/2, 1/3, 1/4 over 25/12: 24/25·T, 12/25·T, 8/25·T, 6/25·T = 9.6, 4.8,
  // 3.2, 2.4 → floors 18, remainders .6 .8 .2 .4 → experts 1 and 0 get the 2 left: 10, 5, 3, 2.
  x = expected_loads(parse_routing_model("zipf=1"), shape, 10, 0);
  EXPECT_EQ(x.copies[1], (std::vector<int64_t>{10, 5, 3, 2}));
  EXPECT_FALSE(x.clamped);
  // zipf=2: expert 0 wants 2/(1 + 1/4 + 1/9 + 1/16) = 1.40 tokens' worth: clamped to 1; the other
  // copy splits 1/4 : 1/9 : 1/16 → 5.90, 2.62, 1.48 → 5, 2, 1 + the 2 left to experts 1, 2.
  x = expected_loads(parse_routing_model("zipf=2"), shape, 10, 0);
  EXPECT_EQ(x.copies[0], (std::vector<int64_t>{10, 6, 3, 1}));
  EXPECT_TRUE(x.clamped);
  // Every row sums to exactly T·k; no entry exceeds T.
  for (const char* text : {"zipf=0.7", "hot-expert=0.9,3", "rho=3.3", "hot-rank=1"}) {
    const RoutingShape wide{4, 16, 3};
    const ExpectedLoads y = expected_loads(parse_routing_model(text), wide, 1001, 0);
    for (const auto& row : y.copies) {
      int64_t sum = 0;
      for (int64_t c : row) {
        EXPECT_LE(c, 1001) << text;
        sum += c;
      }
      EXPECT_EQ(sum, 1001 * 3) << text;
    }
  }
}

TEST(RoutingFileModel, ParsedPerSourceRowAndLayer) {
  const std::string path = write_temp(
      "routing_file_test.json",
      R"({"flatpeak_routing": 1, "ep_ranks": 2, "num_experts": 4,
          "layers": [[[1, 1, 1, 1], [3, 1, 0, 0]], [[0, 0, 1, 1], [1, 1, 1, 1]]]})");
  const RoutingModel m = parse_routing_model("file=" + path);
  EXPECT_EQ(to_string(m), "file=" + path);
  ASSERT_TRUE(m.file);
  EXPECT_EQ(m.file->layers.size(), 2u);
  const RoutingShape shape{2, 4, 2};
  EXPECT_NO_THROW(validate_routing_model(m, shape, 2));
  // Layer 0: row 0 balanced; row 1 wants 0.75 on expert 0 (> 1/2): clamped to 10, the other
  // token's worth goes to the only other expert with a share (expert 1).
  ExpectedLoads x = expected_loads(m, shape, 10, 0);
  EXPECT_EQ(x.copies, (CountMatrix{{5, 5, 5, 5}, {10, 10, 0, 0}}));
  EXPECT_TRUE(x.clamped);
  EXPECT_NE(x.clamp_note.find("source rank 1"), std::string::npos) << x.clamp_note;
  // Layer 3 uses matrix 3 % 2 = 1.
  x = expected_loads(m, shape, 10, 3);
  EXPECT_EQ(x.copies, (CountMatrix{{0, 0, 10, 10}, {5, 5, 5, 5}}));

  try {
    validate_routing_model(m, RoutingShape{4, 8, 2}, 3);
    FAIL() << "mismatched file accepted";
  } catch (const InputError& e) {
    ASSERT_EQ(e.diagnostics().size(), 3u);
    EXPECT_EQ(e.diagnostics()[0].to_string(), path + ": /ep_ranks: must equal EP = 4 (got 2)");
    EXPECT_EQ(e.diagnostics()[1].to_string(), path + ": /num_experts: must equal E = 8 (got 4)");
    EXPECT_EQ(e.diagnostics()[2].to_string(),
              path + ": /layers: must hold 1 matrix or one per MoE layer (3) (got 2)");
  }
}

TEST(RoutingFileModel, BadFilesNameThePointer) {
  try {
    parse_routing_file(R"({"flatpeak_routing": 1, "ep_ranks": 2, "num_experts": 2, "layer": [],
                          "layers": [[[1, -1], [0, 0]]]})", "r.json");
    FAIL() << "bad file accepted";
  } catch (const InputError& e) {
    ASSERT_EQ(e.diagnostics().size(), 3u);
    EXPECT_EQ(e.diagnostics()[0].to_string(), "r.json: /layer: unknown key");
    EXPECT_EQ(e.diagnostics()[0].hint, "did you mean \"layers\"?");
    EXPECT_EQ(e.diagnostics()[1].to_string(), "r.json: /layers/0/0/1: must be an integer in 0..2^40 (got -1)");
    EXPECT_EQ(e.diagnostics()[2].to_string(), "r.json: /layers/0/1: must have a positive sum (got all zeros)");
  }
}

TEST(GenerateRouting, DeterministicDistinctAndPinned) {
  const RoutingShape shape{4, 16, 4};
  const RoutingModel m = parse_routing_model("zipf=1.1");
  const auto a = generate_routing(m, shape, 500, 42, 3, 3, 7);
  const auto b = generate_routing(m, shape, 500, 42, 3, 3, 7);
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), 2000u);
  EXPECT_NE(a, generate_routing(m, shape, 500, 43, 3, 3, 7));  // seed
  EXPECT_NE(a, generate_routing(m, shape, 500, 42, 2, 3, 7));  // rank
  EXPECT_NE(a, generate_routing(m, shape, 500, 42, 3, 3, 6));  // layer
  // Token t's ids depend on t alone, not on how many tokens are generated.
  const auto prefix = generate_routing(m, shape, 100, 42, 3, 3, 7);
  EXPECT_TRUE(std::equal(prefix.begin(), prefix.end(), a.begin()));
  for (size_t t = 0; t < 500; ++t) {
    std::set<int32_t> ids(a.begin() + static_cast<long>(t * 4), a.begin() + static_cast<long>(t * 4 + 4));
    EXPECT_EQ(ids.size(), 4u) << "token " << t;
    EXPECT_GE(*ids.begin(), 0);
    EXPECT_LT(*ids.rbegin(), 16);
  }
  // Regression pin of the documented integer algorithm (splitmix64 stream, Fisher-Yates by
  // multiply-shift, systematic sampling in 2^-30 units): these ids must be the same on every
  // platform; a change here changes every realised routing. The same ids come from an
  // independent Python rendering of the algorithm as the header documents it.
  const auto pin = generate_routing(parse_routing_model("balanced"), RoutingShape{2, 8, 2}, 4, 1, 0, 0, 0);
  EXPECT_EQ(pin, (std::vector<int32_t>{3, 5, 0, 7, 7, 3, 7, 6}));
}

TEST(GenerateRouting, HotExpertFullyHotPicksOnlyHotExperts) {
  // f = 1, h = k = 2: each token takes exactly experts 0 and 1 (inclusion probability 1 each).
  const auto ids = generate_routing(parse_routing_model("hot-expert=1,2"), RoutingShape{2, 8, 2}, 50, 5, 0, 0, 0);
  EXPECT_EQ(count_routing(ids, RoutingShape{2, 8, 2}), (std::vector<int64_t>{50, 50, 0, 0, 0, 0, 0, 0}));
}

TEST(CountRouting, CountsAndMatrix) {
  const RoutingShape shape{2, 4, 2};
  const std::vector<int32_t> r0 = {0, 1, 0, 3, 2, 0};  // 3 tokens × k = 2
  const std::vector<int32_t> r1 = {3, 2, 3, 1};
  EXPECT_EQ(count_routing(r0, shape), (std::vector<int64_t>{3, 1, 1, 1}));
  EXPECT_EQ(count_matrix({r0, r1}, shape), (CountMatrix{{3, 1, 1, 1}, {0, 1, 1, 2}}));
  EXPECT_THROW(count_routing({4}, shape), std::out_of_range);
  EXPECT_THROW(count_matrix({r0}, shape), std::invalid_argument);
}

// Realised counts converge to the expected loads: with a fixed seed, T = 20000 tokens per source
// and k = 4 of E = 16, every expert's realised count is within 5·sqrt(expected) + 5 of the
// expected one (the count is a sum of T independent indicators, so its standard deviation is at
// most sqrt(expected)), and every rank's received rows within 1%.
TEST(GenerateRouting, RealisedCountsFollowEachModel) {
  const RoutingShape shape{4, 16, 4};
  const int64_t tokens = 20000;
  const std::string path = write_temp(
      "routing_converge.json",
      R"({"flatpeak_routing": 1, "ep_ranks": 4, "num_experts": 16, "layers": [[
          [9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6, 7, 8, 9, 8, 7, 6, 5, 4, 3, 2],
          [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]]]})");
  const std::vector<std::string> models = {"balanced", "rho=2.5", "hot-expert=0.6,3",
                                           "hot-rank=0.7", "zipf=1.2", "file=" + path};
  for (const std::string& text : models) {
    const RoutingModel m = parse_routing_model(text);
    const ExpectedLoads expected = expected_loads(m, shape, tokens, 2);
    std::vector<std::vector<int32_t>> ids;
    for (int64_t s = 0; s < shape.ep_ranks; ++s) ids.push_back(generate_routing(m, shape, tokens, 2024, s, s, 2));
    const CountMatrix realised = count_matrix(ids, shape);
    for (size_t s = 0; s < 4; ++s) {
      for (size_t e = 0; e < 16; ++e) {
        const double want = static_cast<double>(expected.copies[s][e]);
        EXPECT_NEAR(static_cast<double>(realised[s][e]), want, 5.0 * std::sqrt(want) + 5.0)
            << text << " source " << s << " expert " << e;
      }
    }
    const auto want_rows = received_rows_per_rank(expected.copies, shape);
    const auto got_rows = received_rows_per_rank(realised, shape);
    for (size_t p = 0; p < 4; ++p) {
      EXPECT_NEAR(static_cast<double>(got_rows[p]), static_cast<double>(want_rows[p]),
                  0.01 * static_cast<double>(want_rows[p]) + 5.0) << text << " rank " << p;
    }
  }
}

}  // namespace
}  // namespace flatpeak
