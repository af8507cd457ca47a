#!/usr/bin/env bash
# The optional GPU kernels' items alone (also in bench/gpu_suite.sh), for a short lent GPU (one H100/H200, bf16):
# ours against flash-linear-attention's gated delta rule (Qwen3-Next's heads) and chunk_kda (Kimi-Linear-48B-A3B's),
# and against mamba-ssm's scan with causal-conv1d (Nemotron-H-8B's Mamba-2), T = 2k and 8k, forward + backward:
# equality of the output and every gradient, and the time ratio. The libraries' wheels go in .whl/ (installed to
# /tmp/site by bench/gpu_common.sh); a missing one gives its item a skip line. One JSON line per result in
# $OUT/results.jsonl; each item has its own timeout, capped by what is left of SUITE_BUDGET_S (300 s).
#
#   OUT=/tmp/kernels-out bash bench/gpu_kernels.sh   # on the GPU machine, from the repository root (~2-4 min)
#   SMOKE=1 bash bench/gpu_kernels.sh                # CPU dry run (also: --dry-run): each item's skip line
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=${SUITE_BUDGET_S:-300}
source bench/gpu_common.sh "$@"

if [[ "$SMOKE" == 1 ]]; then
  item gated_delta_fla 30 python3 bench/gated_delta_fla.py --shape 1,2,4,32,128 --rounds 1
  item kda_fla 30 python3 bench/kda_fla.py --shape 1,2,32,128 --rounds 1
  item mamba2_ssm 30 python3 bench/mamba2_ssm.py --shape 1,4,16,2,16,128 --rounds 1
else
  item gated_delta_fla 90 python3 bench/gated_delta_fla.py --dtype bf16 --shape 1,16,32,128,2048 1,16,32,128,8192
  item kda_fla 90 python3 bench/kda_fla.py --dtype bf16 --shape 1,32,128,2048 1,32,128,8192
  item mamba2_ssm 90 python3 bench/mamba2_ssm.py --dtype bf16 --shape 1,128,64,8,128,2048 1,128,64,8,128,8192
fi
echo "kernel items done in $(( $(date +%s) - START ))s; results in $RESULTS" >&2
