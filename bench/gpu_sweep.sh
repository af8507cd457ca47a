#!/usr/bin/env bash
# The issue-13 speed candidates in one prepared GPU run (one H100/H200, bf16), under 9.5 minutes, cheapest and
# most telling first:
#   1. GEMM ceiling (bf16 and FP8) of this GPU, the yardstick for the MFU figures;
#   2. FP8 loss gap at the Llama-3-8B layer shape after 200 steps: bf16, bf16 with another seed (the noise floor),
#      tensorwise, tensorwise with the first/last blocks in bf16;
#   3. Llama-1B shape: MFU per candidate (per-block compile with flash or cuDNN attention, FP8, whole-model compile);
#   4. GPT-2 XL shape: the compiled nanoGPT-style reference once, then our candidates, tokens/s and ratio each (an
#      FP8 variant is named as such: a different precision from the reference);
#   5. a GPU-kernel profile of our Llama-1B step (time by kernel family, GPU-busy share of the step).
# JSON lines go to $OUT/results.jsonl as soon as they exist; each item has its own timeout, capped by what is left
# of SWEEP_BUDGET_S. Logs: $OUT/<item>.log (tar them: the device tool brings back at most 8 files). The GPU page's
# table of the run: $OUT/gpu-sweep.json (bench/gpu_tables.py).
#
#   bash bench/gpu_sweep.sh                   # on the GPU machine (wheels from .whl/ installed to /tmp/site)
#   SMOKE=1 bash bench/gpu_sweep.sh           # CPU dry run with tiny shapes (also: --dry-run)
#   ITEMS="llama fp8" bash bench/gpu_sweep.sh # a subset: gemm fp8 llama gpt2xl profile
#   TIMEOUT_gpt2xl=300 bash bench/gpu_sweep.sh  # an item's own time limit
set -uo pipefail
cd "$(dirname "$0")/.."
ITEMS=${ITEMS:-gemm fp8 llama gpt2xl profile}
BUDGET=${SWEEP_BUDGET_S:-560}
source bench/gpu_common.sh "$@"

SWEEP="python3 bench/speed_sweep.py --dtype bf16"
# Variants, cheapest compile first so a cut-short item still reports the most; whole-model compile (~70 s at GPT-2
# XL) last.
# Each list can be replaced from the environment, e.g. GPT_VARIANTS="model+plain blocks+autotune+plain" (what the
# 2026-11-26 H100 run did not reach: its whole-model GPT-2 XL compile ran out of the item's time).
GPT_VARIANTS=${GPT_VARIANTS:-"blocks+plain blocks+cudnn+plain blocks+cudnn+plain+tensorwise model+cudnn+plain"}
LLAMA_VARIANTS=${LLAMA_VARIANTS:-"blocks+plain blocks+cudnn+plain blocks+cudnn+plain+tensorwise model+cudnn+plain"}
FP8_RECIPES=${FP8_RECIPES:-"off off@seed1 tensorwise tensorwise+ends"}
FP8_COMPILE=${FP8_COMPILE:-blocks}  # or model: whole-model compile of the four layers
if [[ "$SMOKE" == 1 ]]; then
  item gemm 60 python3 bench/gemm_ceiling.py --n 256 --seconds 0.2 --device cpu
  item fp8 200 python3 bench/fp8_layers.py --shape tiny-llama --steps 12 --compile off --device cpu --emulate \
    --recipes $FP8_RECIPES
  item llama 300 $SWEEP --shape tiny-llama --reference none --device cpu --emulate --variants $LLAMA_VARIANTS \
    --steps 2 --rounds 1 --warmup 1
  item gpt2xl 400 $SWEEP --shape tiny --device cpu --emulate --variants $GPT_VARIANTS --steps 2 --rounds 1 --warmup 1
  item profile 120 python3 bench/profile_step.py --shape tiny-llama --device cpu --variant off+plain --sides ours \
    --steps 2
else
  item gemm 25 python3 bench/gemm_ceiling.py --n 8192 --seconds 1
  item fp8 150 python3 bench/fp8_layers.py --shape llama8b-layers --steps 200 --compile "$FP8_COMPILE" \
    --recipes $FP8_RECIPES
  item llama 130 $SWEEP --shape llama-1b --reference none --variants $LLAMA_VARIANTS --steps 6 --rounds 2 --warmup 3
  item gpt2xl 230 $SWEEP --shape gpt2-xl --variants $GPT_VARIANTS --steps 8 --rounds 2 --warmup 3
  item profile 60 python3 bench/profile_step.py --shape llama-1b --device cuda --variant blocks+cudnn+plain \
    --sides ours --steps 3
fi
# The GPU page's table of this run (copy it to docs/benchmarks/data/gpu-<order>-<gpu>.json, then render)
python3 bench/gpu_tables.py sweep --results "$RESULTS" --table "$OUT/gpu-sweep.json" --machine "$MACHINE"
echo "sweep done in $(( $(date +%s) - START ))s; results in $RESULTS" >&2
