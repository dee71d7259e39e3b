// The `plan` table for people: the five peaks, the GPU and host verdicts, the baseline beside.
//   std::cout << format_plan_table(plan);
#pragma once

#include <string>

#include "plan.h"

namespace flatpeak::cli {

std::string format_plan_table(const planner::Plan& plan);

}  // namespace flatpeak::cli
