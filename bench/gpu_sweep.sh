#!/usr/bin/env bash
# The issue-13 speed candidates in one prepared GPU run (one H100/H200, bf16), under 8 minutes, most telling first:
#   1. GPT-2 XL shape: the compiled nanoGPT-style reference once, then our per-block / whole-model compile, plain vs
#      fused loss, cuDNN attention first, inductor max-autotune: tokens/s and ratio to the reference each;
#   2. Llama-1B shape: MFU per candidate (per-block compile, plain loss, cuDNN attention, whole-model compile);
#   3. FP8 loss gap at the Llama-3-8B layer shape: bf16, bf16 with another seed (the noise floor), tensorwise,
#      tensorwise with the first/last blocks in bf16, rowwise (e4m3 gradients, power-of-2 scales).
# JSON lines go to $OUT/results.jsonl as soon as they exist; each item has its own timeout, capped by what is left
# of SWEEP_BUDGET_S. Logs: $OUT/<item>.log (tar them: the device tool brings back at most 8 files).
#
#   bash bench/gpu_sweep.sh                   # on the GPU machine (wheels from .whl/ installed to /tmp/site)
#   SMOKE=1 bash bench/gpu_sweep.sh           # CPU dry run with tiny shapes (also: --dry-run)
#   ITEMS="llama fp8" bash bench/gpu_sweep.sh # a subset: gpt2xl llama fp8
set -uo pipefail
cd "$(dirname "$0")/.."
ITEMS=${ITEMS:-gpt2xl llama fp8}
BUDGET=${SWEEP_BUDGET_S:-465}
source bench/gpu_common.sh "$@"

SWEEP="python3 bench/speed_sweep.py --dtype bf16"
# Variants, cheapest compile first so a cut-short item still reports the most; whole-model compile (~70 s at GPT-2
# XL) and max-autotune (GEMM tuning, time unknown) last. The last item gets whatever budget the others left.
GPT_VARIANTS="blocks+plain blocks blocks+cudnn+plain model+plain blocks+autotune+plain"
LLAMA_VARIANTS="blocks+plain blocks+cudnn+plain blocks model+plain"
FP8_RECIPES="off off@seed1 tensorwise tensorwise+ends rowwise"
if [[ "$SMOKE" == 1 ]]; then
  item gpt2xl 400 $SWEEP --shape tiny --device cpu --variants $GPT_VARIANTS --steps 2 --rounds 1 --warmup 1
  item llama 300 $SWEEP --shape tiny-llama --reference none --device cpu --variants $LLAMA_VARIANTS --steps 2 \
    --rounds 1 --warmup 1
  item fp8 200 python3 bench/fp8_layers.py --shape tiny-llama --steps 12 --compile off --device cpu --emulate \
    --recipes $FP8_RECIPES
else
  item gpt2xl 210 $SWEEP --shape gpt2-xl --variants $GPT_VARIANTS --steps 8 --rounds 2 --warmup 3
  item llama 120 $SWEEP --shape llama-1b --reference none --variants $LLAMA_VARIANTS --steps 6 --rounds 2 --warmup 3
  item fp8 300 python3 bench/fp8_layers.py --shape llama8b-layers --steps 100 --compile blocks --recipes $FP8_RECIPES
fi
echo "sweep done in $(( $(date +%s) - START ))s; results in $RESULTS" >&2
