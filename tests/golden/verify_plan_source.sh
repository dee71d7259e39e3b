#!/usr/bin/env bash
# `verify` reads a plan's model and hardware where the planner read them: a Hugging Face
# config.json or a card file named by /inputs/{model,hardware}/source, not only a built-in card
# (CTest golden.verify_plan_source); a relative source from where verify runs, else beside the
# plan. A file gone since the plan was made, or changed, is an input error (exit 2) naming the field.
#   verify_plan_source.sh FLATPEAK REPO_ROOT
set -u
flatpeak=$1 root=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "verify_plan_source: FAILED: $*"; exit 1; }
cd "$dir" || fail "no temporary folder"

# A model no card describes (DeepSeek-V2-Lite's config.json) on a hardware card of another name.
mkdir model
cp "$root/tests/data/hf/DeepSeek-V2-Lite/config.json" model/config.json
sed 's/"name": "H200"/"name": "H200-lab"/' "$root/models/hardware/H200.json" >lab.json
grep -q '"name": "H200-lab"' lab.json || fail "could not rename the hardware card"
"$flatpeak" plan --model model/config.json --gpu lab.json --gpus 8 --context 16K --format json >plan.json 2>plan.err
rc=$?
[ $rc = 0 ] || fail "plan exited $rc: $(cat plan.err)"
"$flatpeak" verify plan.json --component vocab --max-ranks 1 >ok.out 2>ok.err
rc=$?
[ $rc = 0 ] || fail "verify of a plan from files exited $rc (expected 0): $(cat ok.err)"
grep -q "verdict: pass" ok.out || fail "no pass verdict: $(tail -3 ok.out)"

# Verified from another folder: the relative sources are found beside the plan.
mkdir elsewhere
(cd elsewhere && "$flatpeak" verify ../plan.json --component vocab --max-ranks 1 >../beside.out 2>../beside.err)
rc=$?
[ $rc = 0 ] || fail "verify from another folder exited $rc (expected 0): $(cat beside.err)"
grep -q "verdict: pass" beside.out || fail "no pass verdict from another folder: $(tail -3 beside.out)"

# The config changed since: the field it changed is named.
sed 's/"hidden_size": 2048/"hidden_size": 4096/' "$root/tests/data/hf/DeepSeek-V2-Lite/config.json" >model/config.json
"$flatpeak" verify plan.json --component vocab --max-ranks 1 >changed.out 2>changed.err
rc=$?
[ $rc = 2 ] || fail "a changed config exited $rc (expected 2): $(cat changed.err)"
grep -q "/inputs/model/hidden_size: is 2048, but 'model/config.json' now gives 4096: the file changed" changed.err ||
  fail "the changed field is not named: $(cat changed.err)"

# The config gone: the source field is named, with what to do.
rm model/config.json
"$flatpeak" verify plan.json --component vocab --max-ranks 1 >gone.out 2>gone.err
rc=$?
[ $rc = 2 ] || fail "a missing config exited $rc (expected 2): $(cat gone.err)"
grep -q "/inputs/model/source: names 'model/config.json', which cannot be read" gone.err ||
  fail "the source field is not named: $(cat gone.err)"
grep -q "hint: run verify from the folder the plan was made in" gone.err || fail "no hint: $(cat gone.err)"

# The hardware card gone.
cp "$root/tests/data/hf/DeepSeek-V2-Lite/config.json" model/config.json
rm lab.json
"$flatpeak" verify plan.json --component vocab --max-ranks 1 >hw.out 2>hw.err
rc=$?
[ $rc = 2 ] || fail "a missing hardware card exited $rc (expected 2): $(cat hw.err)"
grep -q "/inputs/hardware/source: names 'lab.json', which cannot be read" hw.err ||
  fail "the hardware source field is not named: $(cat hw.err)"
# A card whose shared experts' gate was switched off since the plan: the field is named.
sed -e 's/"name": "GLM-4.5"/"name": "GLM-4.5-gated"/' -e 's/"n_shared_experts": 1,/"n_shared_experts": 1, "shared_expert_gate": true,/' \
  "$root/models/GLM-4.5.json" >gated.json
grep -q '"shared_expert_gate": true' gated.json || fail "could not write the gated card"
"$flatpeak" plan --model gated.json --gpu H200 --gpus 16 --context 16K --format json >gated_plan.json 2>gated_plan.err
rc=$?
[ $rc = 0 ] || [ $rc = 3 ] || fail "plan of the gated card exited $rc: $(cat gated_plan.err)"  # 3: does not fit
grep -q '"shared_expert_gate": true' gated_plan.json || fail "the plan does not record the gate"
sed -i 's/ "shared_expert_gate": true,//' gated.json
"$flatpeak" verify gated_plan.json --component vocab --max-ranks 2 >ungated.out 2>ungated.err
rc=$?
[ $rc = 2 ] || fail "a card that lost its gate exited $rc (expected 2): $(cat ungated.err)"
grep -q "/inputs/model/shared_expert_gate: is true, but 'gated.json' now gives false: the file changed" ungated.err ||
  fail "the gate is not named: $(cat ungated.err)"
echo "verify_plan_source: ok"
