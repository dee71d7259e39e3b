// Hardware cards: device-reported memory from the reference figures, aliases, and validation
// that reports every problem in one pass.
#include "spec/hardware_loader.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "spec/errors.h"

namespace flatpeak {
namespace {

std::vector<std::string> messages_of(const InputError& error) {
  std::vector<std::string> messages;
  for (const auto& d : error.diagnostics()) messages.push_back(d.to_string());
  return messages;
}

TEST(HardwareCards, DeviceReportedMemory) {
  // nvidia-smi / rocm-smi figures (reference/models/README.md, "Accelerators").
  EXPECT_EQ(load_hardware("H100-80GB").device_memory_bytes, int64_t{85520809984});
  EXPECT_EQ(load_hardware("H200").device_memory_bytes, int64_t{150754820096});
  EXPECT_EQ(load_hardware("A100-80GB").device_memory_bytes, int64_t{85899345920});
  EXPECT_EQ(load_hardware("B200").device_memory_bytes, int64_t{192265846784});
  EXPECT_EQ(load_hardware("GB200").device_memory_bytes, int64_t{198674743296});
  EXPECT_EQ(load_hardware("MI300X").device_memory_bytes, int64_t{205822885888});
}

TEST(HardwareCards, PerDirectionBandwidthsAndNode) {
  const HardwareSpec h200 = load_hardware("H200");
  EXPECT_DOUBLE_EQ(h200.scale_up_bandwidth_bytes_per_s, 450e9);  // 900 GB/s bidirectional
  EXPECT_DOUBLE_EQ(h200.host_link_bandwidth_bytes_per_s, 64e9);  // PCIe Gen5 x16, 128 bidirectional
  EXPECT_DOUBLE_EQ(h200.hbm_bandwidth_bytes_per_s, 4.8e12);
  EXPECT_DOUBLE_EQ(h200.bf16_dense_flops, 989.4e12);
  EXPECT_EQ(h200.gpus_per_node, 8);
  EXPECT_EQ(h200.host_memory_bytes_per_node, int64_t{2048000000000});
  EXPECT_EQ(h200.runtime_overhead_bytes, int64_t{3} << 30);
  EXPECT_DOUBLE_EQ(h200.fragmentation_fraction, 0.05);
  EXPECT_EQ(load_hardware("GB200").gpus_per_node, 4);
}

TEST(HardwareCards, AliasesAreCaseInsensitive) {
  EXPECT_EQ(load_hardware("H100").name, "H100-80GB");
  EXPECT_EQ(load_hardware("h100").name, "H100-80GB");
  EXPECT_EQ(load_hardware("H200-141GB").name, "H200");
  EXPECT_EQ(load_hardware("a100").name, "A100-80GB");
  EXPECT_EQ(list_hardware_cards().size(), 7u);
}

TEST(HardwareCards, UnknownNameSuggestsTheNearest) {
  try {
    load_hardware("H300");
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u);
    EXPECT_EQ(e.diagnostics()[0].to_string(), "--gpu: unknown hardware 'H300'");
    EXPECT_EQ(e.diagnostics()[0].hint.rfind("did you mean 'H100'? hardware cards: A100-80GB, B200, GB200, H100-80GB, H200, MI300X, MI325X", 0), 0u)
        << e.diagnostics()[0].hint;
  }
}

TEST(HardwareCards, EveryProblemInOnePass) {
  nlohmann::json card = nlohmann::json::parse(R"({
    "name": "X", "aliases": ["Y", 3], "device_memory_bytes": 0, "hbm_bandwidth_bytes_per_s": "fast",
    "bf16_dense_flops": 1e15, "scale_up_bandwidth_bytes_per_s": 1e11, "host_link_bandwidth_bytes_per_s": 6e10,
    "inter_node_bandwidth_bytes_per_s": 5e10, "gpus_per_node": 8, "host_memory_bytes_per_node": 1000,
    "host_memory_bandwidth_bytes_per_s": 1e11, "cpu_cores_per_node": 64, "runtime_overhead_bytes": 0,
    "fragmentation_fraction": 1.5, "allocation_alignment_bytes": 500, "overhead_calibrated": false,
    "gpus_per_nod": 8 })");
  try {
    parse_hardware_card(card, "x.json");
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    const std::vector<std::string> expected = {
        "x.json: /aliases/1: must be a string (got 3)",
        "x.json: /device_memory_bytes: must be a positive integer (got 0)",
        "x.json: /hbm_bandwidth_bytes_per_s: must be a rate per second in [1e6, 1e21] (got \"fast\")",
        "x.json: /fragmentation_fraction: must be a number in [0, 1) (got 1.5)",
        "x.json: /gpus_per_nod: unknown key (did you mean \"gpus_per_node\"?)",
        "x.json: /allocation_alignment_bytes: must be a power of two (got 500)",
    };
    EXPECT_EQ(messages_of(e), expected);
  }
}

// Sizes that would overflow the planner's 64-bit sums are card errors naming the key (they were
// reported as a --context overflow), and the documentation keys keep their types.
TEST(HardwareCards, SizesAreBoundedAndDocumentationTyped) {
  nlohmann::json card = nlohmann::json::parse(R"({
    "name": "X", "aliases": [], "description": 7, "notes": "none", "device_memory_bytes": 9223372036854775807,
    "hbm_bandwidth_bytes_per_s": 4.8e12, "bf16_dense_flops": 1e15, "scale_up_bandwidth_bytes_per_s": 1e11,
    "host_link_bandwidth_bytes_per_s": 6e10, "inter_node_bandwidth_bytes_per_s": 5e10, "gpus_per_node": 8,
    "host_memory_bytes_per_node": 1000, "host_memory_bandwidth_bytes_per_s": 1e11, "cpu_cores_per_node": 64,
    "runtime_overhead_bytes": 1125899906842625, "fragmentation_fraction": 0.05,
    "allocation_alignment_bytes": 2147483648, "overhead_calibrated": false })");
  try {
    parse_hardware_card(card, "x.json");
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    const std::vector<std::string> expected = {
        "x.json: /description: must be a string (got 7)",
        "x.json: /notes: must be an object (got \"none\")",
        "x.json: /device_memory_bytes: must be at most 1125899906842624 (got 9223372036854775807)",
        "x.json: /runtime_overhead_bytes: must be at most 1125899906842624 (got 1125899906842625)",
        "x.json: /allocation_alignment_bytes: must be at most 1073741824 (got 2147483648)",
    };
    EXPECT_EQ(messages_of(e), expected);
  }
}

// A card flatpeak_calibrate calibrated: the H200 card with its overhead's parts.
nlohmann::json calibrated_card(int64_t nccl_bytes) {
  nlohmann::json card = nlohmann::json::parse(R"({
    "name": "H200-calibrated", "aliases": [], "device_memory_bytes": 150754820096, "hbm_bandwidth_bytes_per_s": 4.8e12,
    "bf16_dense_flops": 989.4e12, "scale_up_bandwidth_bytes_per_s": 450e9, "host_link_bandwidth_bytes_per_s": 64e9,
    "inter_node_bandwidth_bytes_per_s": 50e9, "gpus_per_node": 8, "host_memory_bytes_per_node": 2048000000000,
    "host_memory_bandwidth_bytes_per_s": 5e11, "cpu_cores_per_node": 96, "runtime_overhead_bytes": 700000000,
    "fragmentation_fraction": 0.05, "allocation_alignment_bytes": 512, "overhead_calibrated": true })");
  card["runtime_overhead_terms"] = {{"cuda_context_bytes", 520000000}, {"cublas_bytes", 80000000},
                                    {"cublas_workspace_bytes", 33554432}, {"nccl_bytes", nccl_bytes}};
  return card;
}

TEST(HardwareCards, CalibratedOverheadTermsAddUp) {
  const HardwareSpec ok = parse_hardware_card(calibrated_card(700000000 - 520000000 - 80000000 - 33554432), "c.json");
  EXPECT_TRUE(ok.runtime_overhead_terms.present);
  EXPECT_EQ(ok.runtime_overhead_terms.nccl_bytes, 700000000 - 520000000 - 80000000 - 33554432);
  EXPECT_EQ(ok.runtime_overhead_terms.sum(), ok.runtime_overhead_bytes);
  EXPECT_FALSE(load_hardware("H200").runtime_overhead_terms.present);  // the shipped cards are not calibrated yet

  try {
    parse_hardware_card(calibrated_card(1), "c.json");
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_EQ(messages_of(e), std::vector<std::string>{"c.json: /runtime_overhead_terms: must add up to runtime_overhead_bytes = "
                                                       "700000000 (got 520000000 + 80000000 + 33554432 + 1 = 633554433)"});
  }
  nlohmann::json bad = calibrated_card(0);
  bad["runtime_overhead_terms"]["nccl_byte"] = 3;
  bad["runtime_overhead_terms"]["cublas_bytes"] = -1;
  try {
    parse_hardware_card(bad, "c.json");
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    const std::vector<std::string> expected = {
        "c.json: /runtime_overhead_terms/cublas_bytes: must be an integer >= 0 (got -1)",
        "c.json: /runtime_overhead_terms/nccl_byte: unknown key (did you mean \"nccl_bytes\"?)",
    };
    EXPECT_EQ(messages_of(e), expected);
  }
}

// Parts near 2^63 wrapped the sum: 2^63-1 + 2^63-1 + 2 + 3 GiB "added up" to 3 GiB.
TEST(HardwareCards, OverheadTermsCannotWrapTheirSum) {
  nlohmann::json card = calibrated_card(2);
  card["runtime_overhead_bytes"] = int64_t{3} << 30;
  card["runtime_overhead_terms"] = {{"cuda_context_bytes", INT64_MAX}, {"cublas_bytes", INT64_MAX},
                                    {"cublas_workspace_bytes", 2}, {"nccl_bytes", int64_t{3} << 30}};
  try {
    parse_hardware_card(card, "c.json");
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    const std::vector<std::string> expected = {
        "c.json: /runtime_overhead_terms/cuda_context_bytes: must be at most 1125899906842624 (got 9223372036854775807)",
        "c.json: /runtime_overhead_terms/cublas_bytes: must be at most 1125899906842624 (got 9223372036854775807)",
    };
    EXPECT_EQ(messages_of(e), expected);
  }
}

// A bandwidth or throughput of 1e-300 made the step time inf or NaN (exit 0); 1e300 made it 0.
TEST(HardwareCards, RatesAreBoundedSoTimesStayFinite) {
  for (const char* key : {"hbm_bandwidth_bytes_per_s", "bf16_dense_flops", "scale_up_bandwidth_bytes_per_s",
                          "host_link_bandwidth_bytes_per_s", "inter_node_bandwidth_bytes_per_s",
                          "host_memory_bandwidth_bytes_per_s"}) {
    for (double v : {1e-300, 0.0, 999999.0, 1.0000001e21, 1e300}) {
      nlohmann::json card = calibrated_card(700000000 - 520000000 - 80000000 - 33554432);
      card[key] = v;
      try {
        parse_hardware_card(card, "c.json");
        ADD_FAILURE() << key << " = " << v << " was accepted";
      } catch (const InputError& e) {
        ASSERT_EQ(messages_of(e).size(), 1u) << key;
        EXPECT_EQ(messages_of(e)[0].rfind(fmt::format("c.json: /{}: must be a rate per second in [1e6, 1e21] (got ", key), 0), 0u)
            << messages_of(e)[0];
      }
    }
    nlohmann::json edge = calibrated_card(700000000 - 520000000 - 80000000 - 33554432);
    edge[key] = 1e6;
    EXPECT_NO_THROW(parse_hardware_card(edge, "c.json")) << key;
    edge[key] = 1e21;
    EXPECT_NO_THROW(parse_hardware_card(edge, "c.json")) << key;
  }
}

TEST(HardwareCards, NotAnObject) {
  EXPECT_THROW(parse_hardware_card(nlohmann::json::array(), "x.json"), InputError);
  EXPECT_THROW(parse_hardware_card(nlohmann::json(3), "x.json"), InputError);
}

}  // namespace
}  // namespace flatpeak
