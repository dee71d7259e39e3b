// The checkpoint knobs of a plan for `flatpeak verify` (verify_config.h, scale_checkpoint_knobs):
// /knobs/boundaries (device | sync-offload | sco), and with SCO /knobs/sco_layers and
// /knobs/sco_prefetch, checked and scaled to the verified stack of s.layers layers.
//   scale_checkpoint_knobs(in, s);   // s.boundaries, s.sco_offloaded, s.sco_prefetch; s.values
//
// Scaling the offloaded set from L to L' layers: a count n (the first n layers, what SCO's auto
// choice writes) keeps its fraction, n' = round(n · L'/L), but never rounds a partial set to none
// or to all (1 ≤ n' ≤ L'−1 when 0 < n < L and L' ≥ 2); "all" (and "auto", which a plan keeps only
// when no count fits, so every layer is offloaded) stay all; a set of indices is sampled: scaled
// layer j is offloaded when original layer floor(j · L/L') is. The prefetch depth is kept.
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "spec/errors.h"
#include "spec/sizes.h"
#include "verify_config.h"

namespace flatpeak::cli {

namespace {

bool all_digits(const std::string& t) {
  return !t.empty() && t.size() <= 9 && std::all_of(t.begin(), t.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
}

// "0,2,5-9" over L layers -> per-layer flags; false when malformed or out of range.
bool parse_layer_set(const std::string& text, int64_t L, std::vector<bool>& out) {
  out.assign(static_cast<size_t>(L), false);
  size_t pos = 0;
  while (true) {
    const size_t comma = text.find(',', pos);
    const std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    const size_t dash = item.find('-');
    const std::string lo_text = item.substr(0, dash);
    const std::string hi_text = dash == std::string::npos ? lo_text : item.substr(dash + 1);
    // parse_decimal_integer: std::stoll threw out_of_range on 20 digits (an internal error).
    const std::optional<int64_t> lo_value = parse_decimal_integer(lo_text), hi_value = parse_decimal_integer(hi_text);
    if (!all_digits(lo_text) || !all_digits(hi_text) || !lo_value || !hi_value) return false;
    const int64_t lo = *lo_value, hi = *hi_value;
    if (lo > hi || hi >= L) return false;
    for (int64_t i = lo; i <= hi; ++i) out[static_cast<size_t>(i)] = true;
    if (comma == std::string::npos) return true;
    pos = comma + 1;
  }
}

}  // namespace

void scale_checkpoint_knobs(const VerifyInputs& in, ScaledConfig& s) {
  const nlohmann::json& knobs = in.knob_values;
  InputErrors errs;
  auto bad = [&](const std::string& knob, const std::string& rule, const nlohmann::json& value) {
    errs.add(Diagnostic{in.file, "/knobs/" + knob + "/value", rule + " (got " + value.dump() + ")", ""});
  };
  // Every plan writes /knobs/boundaries (run_spec.cpp): one without it was edited.
  s.boundaries = "device";
  if (!knobs.contains("boundaries")) {
    errs.add(Diagnostic{in.file, "/knobs/boundaries", "required field is missing",
                        "device, sync-offload (practice) or sco, as the plan was made"});
  } else {
    const auto& v = knobs["boundaries"];
    const bool practice = in.schedule == "practice";
    if (!v.is_string() || (v != "sco" && v != (practice ? "sync-offload" : "device")))
      bad("boundaries", practice ? "must be sync-offload or sco under schedule practice" : "must be device or sco under schedule " + in.schedule, v);
    else
      s.boundaries = v.get<std::string>();
  }
  const int64_t L = in.layers, Ls = s.layers;
  s.sco_offloaded.assign(static_cast<size_t>(Ls), s.boundaries == "sync-offload");
  s.sco_prefetch = 0;
  if (s.boundaries != "sco") {
    for (const char* knob : {"sco_layers", "sco_prefetch"})
      if (knobs.contains(knob)) bad(knob, "is a knob of SCO, which is off in this plan (/knobs/boundaries/value is " + s.boundaries + ")", knobs[knob]);
    errs.throw_if_any();
    return;
  }
  int64_t offloaded_original = 0;
  if (!knobs.contains("sco_layers")) {
    errs.add(Diagnostic{in.file, "/knobs/sco_layers/value", "required with SCO: all, auto, a count in 0..L or a set of layer indices", ""});
  } else if (const auto& v = knobs["sco_layers"]; !v.is_string()) {
    bad("sco_layers", "must be a string: all, auto, a count in 0..L or a set like 0,2,5-9", v);
  } else {
    const std::string text = v.get<std::string>();
    std::vector<bool> original;
    if (text == "all" || text == "auto") {
      offloaded_original = L;
      s.sco_offloaded.assign(static_cast<size_t>(Ls), true);
    } else if (all_digits(text)) {
      const int64_t n = parse_decimal_integer(text).value_or(L + 1);  // past int64: out of range too
      if (n > L) {
        bad("sco_layers", "a count must lie in 0..L = " + std::to_string(L), v);
      } else {
        offloaded_original = n;
        int64_t scaled = std::llround(static_cast<double>(n) * static_cast<double>(Ls) / static_cast<double>(L));
        if (n > 0 && n < L && Ls >= 2) scaled = std::clamp<int64_t>(scaled, 1, Ls - 1);
        for (int64_t j = 0; j < Ls; ++j) s.sco_offloaded[static_cast<size_t>(j)] = j < scaled;
      }
    } else if (parse_layer_set(text, L, original)) {
      offloaded_original = std::count(original.begin(), original.end(), true);
      for (int64_t j = 0; j < Ls; ++j) s.sco_offloaded[static_cast<size_t>(j)] = original[static_cast<size_t>(j * L / Ls)];
    } else {
      bad("sco_layers", "must be all, auto, a count in 0..L = " + std::to_string(L) + " or a set of layer indices in 0.." +
                            std::to_string(L - 1) + " like 0,2,5-9",
          v);
    }
  }
  if (!knobs.contains("sco_prefetch")) {
    errs.add(Diagnostic{in.file, "/knobs/sco_prefetch/value", "required with SCO: an integer in 0..4", ""});
  } else if (const auto& v = knobs["sco_prefetch"]; !v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 4) {
    bad("sco_prefetch", "must be an integer in 0..4", v);
  } else {
    s.sco_prefetch = v.get<int64_t>();
  }
  errs.throw_if_any();
  s.values.push_back({"SCO offloaded layers", offloaded_original,
                      static_cast<int64_t>(std::count(s.sco_offloaded.begin(), s.sco_offloaded.end(), true))});
  s.values.push_back({"SCO prefetch", s.sco_prefetch, s.sco_prefetch});
}

}  // namespace flatpeak::cli
