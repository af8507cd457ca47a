#!/usr/bin/env bash
# Every GPU measurement of issue 13 in one run (one H100/H200, bf16), from the source tree:
#   GEMM ceiling; fused-loss head memory/time/parity; Llama-1B shape step memory (plain vs chunked loss) and
#   compiled tokens/s + MFU; GPT-2 XL shape eager and compiled vs the nanoGPT-style reference; FP8 vs bf16 at a
#   Llama-3-8B layer shape (tokens/s and loss after the steps); issue 11's initialisation seconds per billion
#   parameters at Llama-3-8B layer shapes (up to 16 layers, 4.5B) against the GPU's RNG throughput; issue 21's MoE
#   layer (grouped_mm / padded / loop vs the dense FFN of the same active FLOPs) at a Mixtral-like and a
#   Qwen3-MoE-like shape (bench/gpu_moe.sh runs them alone); gpt-oss's attention sinks on every SDPA kernel against
#   the math path, and the blockwise kernel QK-clip records with against flash; the gated delta rule, ours against
#   flash-linear-attention's kernel at T = 2k and 8k, KDA against its chunk_kda, Mamba-2 against mamba-ssm's scan
#   and causal-conv1d (each needs its wheels in .whl/; bench/gpu_kernels.sh runs these three alone);
#   last (the earlier items keep their budget), the memory planner against the measured peak at the Llama-1B shape, whose table of the parallel page it
#   writes into $OUT, and issue 43's replica groups on torchft's NCCL process group against torchrun's restart
#   (bench/fault_tolerance.py --backend nccl; 2 GPUs or more, a skip line otherwise).
# Each result is one JSON line appended to $OUT/results.jsonl as soon as it exists; each item has its own
# timeout, capped by what is left of SUITE_BUDGET_S, so one hang cannot eat the run. Logs: $OUT/<item>.log.
#
#   bash bench/gpu_suite.sh                   # on the GPU machine (wheels from .whl/ installed to /tmp/site)
#   SMOKE=1 bash bench/gpu_suite.sh           # CPU dry run with tiny shapes (also: --dry-run)
# The speed candidates (compile modes, SDPA kernel, loss kind, FP8 recipe variants) have their own run: gpu_sweep.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=${SUITE_BUDGET_S:-560}
source bench/gpu_common.sh "$@"

VS="python3 bench/vs_nanogpt.py --dtype bf16"
if [[ "$SMOKE" == 1 ]]; then
  item gemm 60 python3 bench/gemm_ceiling.py --n 256 --seconds 0.2 --device cpu
  item init_speed 60 python3 bench/init_speed.py --device cpu --shape tiny --layers 1 2
  item fused_loss_head 120 python3 bench/fused_loss_memory.py --shape tiny --dtype bf16 --device cpu
  item llama_memory 180 $VS --shape tiny-llama --compile off --loss plain chunked --reference none \
    --device cpu --steps 2 --rounds 1 --warmup 1
  item llama_compiled 300 $VS --shape tiny-llama --compile blocks --reference none --device cpu --steps 2 \
    --rounds 1 --warmup 1
  item gpt2xl_eager 180 $VS --shape tiny --compile off --device cpu --steps 2 --rounds 1 --warmup 1
  item fp8 300 python3 bench/fp8_layers.py --shape tiny-llama --steps 4 --compile off --device cpu --emulate
  item gpt2xl_compiled 300 $VS --shape tiny --compile blocks --device cpu --steps 2 --rounds 1 --warmup 1
  item moe_mixtral 120 python3 bench/moe_layer.py --device cpu --dtype fp32 --shape tiny --rounds 1 --threads 1
  item moe_qwen3 120 python3 bench/moe_layer.py --device cpu --dtype bf16 --shape tiny --rounds 1 --threads 1 \
    --routing skewed
  item attention_sinks 60 python3 bench/attention_sinks.py --device cpu --dtype fp32 --shape tiny --rounds 1
  item gated_delta_fla 30 python3 bench/gated_delta_fla.py --shape 1,2,4,32,128 --rounds 1  # a skip line on CPU
  item kda_fla 30 python3 bench/kda_fla.py --shape 1,2,32,128 --rounds 1  # a skip line on CPU
  item mamba2_ssm 30 python3 bench/mamba2_ssm.py --shape 1,4,16,2,16,128 --rounds 1  # a skip line on CPU
  item plan_memory 120 python3 bench/plan_vs_measured_gpu.py --device cpu --modes none full \
    --table "$OUT/parallel-03-plan-vs-measured-gpu.json" --machine "$MACHINE"
  item fault_tolerance 400 python3 bench/fault_tolerance.py --backend gloo --configs tiny-gpt --groups 2 --ranks 1 \
    --kill-at 6 --checkpoint-every 5 --table "$OUT" --machine "$MACHINE"
else
  item gemm 30 python3 bench/gemm_ceiling.py --n 8192 --seconds 1.5
  item init_speed 25 python3 bench/init_speed.py --layers 1 4 16
  item fused_loss_head 50 python3 bench/fused_loss_memory.py --shape llama-1b-head --dtype bf16 --device cuda
  item llama_memory 60 $VS --shape llama-1b --compile off --loss plain chunked --reference none \
    --steps 3 --rounds 1 --warmup 2
  item llama_compiled 75 $VS --shape llama-1b --compile blocks --loss chunked --reference none \
    --steps 10 --rounds 2 --warmup 3
  item gpt2xl_eager 70 $VS --shape gpt2-xl --compile off --steps 8 --rounds 2 --warmup 2
  item fp8 160 python3 bench/fp8_layers.py --shape llama8b-layers --steps 200 --compile blocks
  item gpt2xl_compiled 140 $VS --shape gpt2-xl --compile blocks --steps 8 --rounds 2 --warmup 3
  item moe_mixtral 100 python3 bench/moe_layer.py --device cuda --dtype bf16 --shape mixtral-reduced --rounds 5
  item moe_qwen3 100 python3 bench/moe_layer.py --device cuda --dtype bf16 --shape qwen3-moe --rounds 5
  # gpt-oss's sinks through flash / cuDNN / efficient (one extra key, widened heads) vs math; QK-clip's kernel cost
  item attention_sinks 60 python3 bench/attention_sinks.py --device cuda --dtype bf16 --shape gpt-oss --rounds 5
  # Qwen3-Next's Gated DeltaNet heads (16 query/key, 32 value, width 128): forward + backward, equality and speed
  item gated_delta_fla 90 python3 bench/gated_delta_fla.py --dtype bf16 --shape 1,16,32,128,2048 1,16,32,128,8192
  # Kimi-Linear-48B-A3B's KDA heads (32, width 128): ours against fla's chunk_kda, equality and speed
  item kda_fla 90 python3 bench/kda_fla.py --dtype bf16 --shape 1,32,128,2048 1,32,128,8192
  # Nemotron-H-8B's Mamba-2 (128 heads of width 64, 8 groups, state 128): ours against mamba-ssm + causal-conv1d
  item mamba2_ssm 90 python3 bench/mamba2_ssm.py --dtype bf16 --shape 1,128,64,8,128,2048 1,128,64,8,128,8192
  # the memory planner against torch.cuda.max_memory_allocated, Llama-1B, per recomputation mode (the parallel page's
  # table, written into $OUT)
  item plan_memory 100 python3 bench/plan_vs_measured_gpu.py \
    --table "$OUT/parallel-03-plan-vs-measured-gpu.json" --machine "$MACHINE"
  # issue 43's replica groups on torchft's NCCL process group against torchrun's restart (one GPU per rank: 2 groups
  # of 1 need 2 GPUs; the fault-tolerance page's table, written into $OUT)
  if (( $(nvidia-smi -L 2>/dev/null | wc -l) >= 2 )); then
    item fault_tolerance 240 python3 bench/fault_tolerance.py --backend nccl --configs tiny-gpt --groups 2 --ranks 1 \
      --table "$OUT" --machine "$MACHINE"
  else
    echo '{"item": "fault_tolerance", "status": "skipped", "reason": "needs 2 GPUs (one per rank)"}' >> "$RESULTS"
  fi
fi
echo "suite done in $(( $(date +%s) - START ))s; results in $RESULTS" >&2
