#!/usr/bin/env bash
# Issue 21's MoE layer items alone, for a short lent GPU (one H100/H200, bf16): bench/moe_layer.py at a
# Mixtral-like layer (d 4096, 8 experts of 7168 = half of Mixtral's 14336, top-2, 8192 tokens) and a Qwen3-MoE-like
# fine-grained one (d 2048, 128 experts of 768, top-8, 8192 tokens), balanced and skewed routing, grouped_mm vs
# padded vs loop vs the dense FFN of the same active FLOPs, synchronised timing, ratios in one run.
# Each result is one JSON line appended to $OUT/results.jsonl as soon as it exists; each item has its own timeout,
# capped by what is left of SUITE_BUDGET_S (420 s), so one hang cannot eat the run. Logs: $OUT/<item>.log.
#
#   OUT=/tmp/moe-out bash bench/gpu_moe.sh      # on the GPU machine, from the repository root (~2-3 min)
#   SMOKE=1 bash bench/gpu_moe.sh               # CPU dry run with tiny shapes (also: --dry-run)
#   ITEMS="moe_mixtral_compiled moe_mixtral_queued moe_mixtral_autotune" OUT=... bash bench/gpu_moe.sh  # the speed goal
set -uo pipefail
cd "$(dirname "$0")/.."
[[ "${1:-}" == "--dry-run" || "${SMOKE:-0}" == 1 ]] && DRY=1 || DRY=0
# 420 s on the GPU; the CPU dry run only proves the items run, on a possibly busy machine: no tight budget there
BUDGET=${SUITE_BUDGET_S:-$(( DRY ? 900 : 420 ))}
source bench/gpu_common.sh "$@"

ML="python3 bench/moe_layer.py"
if [[ "$SMOKE" == 1 ]]; then
  item moe_mixtral 120 $ML --device cpu --dtype fp32 --shape tiny --rounds 1 --threads 1
  item moe_qwen3 120 $ML --device cpu --dtype bf16 --shape tiny --rounds 1 --threads 1 --routing skewed
  item moe_mixtral_queued 300 $ML --device cpu --dtype bf16 --shape tiny --rounds 1 --threads 1 --routing balanced --backend grouped_mm --compile --queue 2
else
  # CUDA init + first cuBLAS/grouped-GEMM calls are in each item's warm-up round; 5 timed rounds per side
  item moe_mixtral 100 $ML --device cuda --dtype bf16 --shape mixtral-reduced --rounds 5
  item moe_qwen3 100 $ML --device cuda --dtype bf16 --shape qwen3-moe --rounds 5
  # both sides under torch.compile, as `train.compile` runs them: inductor fuses the layer's routing/combine glue
  item moe_mixtral_compiled 120 $ML --device cuda --dtype bf16 --shape mixtral-reduced --rounds 5 --backend grouped_mm --compile
  item moe_qwen3_compiled 120 $ML --device cuda --dtype bf16 --shape qwen3-moe --rounds 5 --backend grouped_mm --compile
  # the same, 4 steps per synchronisation (the host ahead, as between a model's layers), with the profile; then with
  # inductor's grouped-GEMM autotuning (train.compile_mode = "max-autotune-no-cudagraphs": Triton templates against
  # the CUTLASS kernel; minutes of autotuning in the warm-up round)
  item moe_mixtral_queued 120 $ML --device cuda --dtype bf16 --shape mixtral-reduced --rounds 5 --backend grouped_mm --compile --queue 4 --profile
  item moe_mixtral_autotune 240 $ML --device cuda --dtype bf16 --shape mixtral-reduced --routing balanced --rounds 5 --backend grouped_mm --compile max-autotune-no-cudagraphs --queue 4
  # The training-side items, where the GPU makes minutes of CPU training take seconds (their JSON is in the logs):
  # tiny-moe vs tiny-gpt at equal active parameters, and the load balance with none / aux loss / bias balancing.
  item moe_vs_dense 170 python3 bench/moe_vs_dense.py --steps ${CURVE_STEPS:-1000} --eval-interval 100 --concurrent \
    --set train.device=cuda --moe-set ${MOE_SET:-} --png "$OUT/moe_vs_dense.png" --work /tmp/moe-vs-dense \
    --table "$OUT/moe-03-vs-dense.json" --machine "$MACHINE"
  item moe_balance 120 python3 bench/moe_balance.py --steps 200 --set train.device=cuda --out /tmp/moe-balance \
    --table "$OUT/moe-04-balance.json" --machine "$MACHINE"
fi
# The MoE page's tables of this run, in $OUT: copy them to docs/benchmarks/data/, then render
python3 bench/gpu_tables.py moe --results "$RESULTS" --table "$OUT/moe-02-layer-gpu.json" --machine "$MACHINE"
echo "moe items done in $(( $(date +%s) - START ))s; results in $RESULTS" >&2
