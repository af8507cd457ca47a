# Shared by bench/gpu_suite.sh and bench/gpu_sweep.sh (source it after `cd` to the repository root, with BUDGET set):
# the environment (wheels from .whl/ on the GPU machine, caches), `item` (one measurement under a timeout capped by
# what is left of BUDGET, its JSON lines kept in $RESULTS), and an environment line first in $RESULTS.
# ITEMS (optional): run only the items named there. MACHINE: the machine, in words, for the benchmark pages' tables
# the scripts write into $OUT (default: the GPU and torch of the environment line).
[[ "${1:-}" == "--dry-run" ]] && SMOKE=1
SMOKE=${SMOKE:-0}
ITEMS=${ITEMS:-}
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
RESULTS=$OUT/results.jsonl
START=$(date +%s)
export PYTHONUNBUFFERED=1 MESHFORMER_CACHE=${MESHFORMER_CACHE:-/tmp/meshformer-cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
if [[ -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1 && [[ "$SMOKE" != 1 ]]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

item() {  # item NAME TIMEOUT_S command...: run with a timeout (TIMEOUT_<NAME> overrides it), keep its JSON lines,
  # note failures as JSON too
  local name=$1 override="TIMEOUT_$1"; local limit=${!override:-$2}; shift 2
  [[ -z "$ITEMS" || " $ITEMS " == *" $name "* ]] || return 0
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if (( left < 15 )); then
    echo "{\"item\": \"$name\", \"status\": \"skipped\", \"reason\": \"budget spent\"}" >> "$RESULTS"; return
  fi
  (( limit > left )) && limit=$left
  local t0=$(date +%s)
  echo "== $name (timeout ${limit}s)" >&2
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep --line-buffered '^{"bench"' >> "$RESULTS"
  local rc=${PIPESTATUS[0]} status=ok
  (( rc == 124 || rc == 137 )) && status=timeout
  (( rc != 0 && rc != 124 && rc != 137 )) && status=error
  echo "{\"item\": \"$name\", \"status\": \"$status\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 ))}" >> "$RESULTS"
  [[ $status != ok ]] && tail -5 "$OUT/$name.log" >&2
}

python3 - >> "$RESULTS" <<'PY'
import json, platform, torch
info = {"bench": "environment", "torch": torch.__version__, "python": platform.python_version(),
        "cuda": torch.cuda.is_available()}
if torch.cuda.is_available():
    info |= {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
             "cudnn": torch.backends.cudnn.version()}
for mod in ("torchao", "liger_kernel", "triton", "fla"):
    try:
        info[mod] = getattr(__import__(mod), "__version__", "importable")
    except Exception as err:
        info[mod] = f"unavailable: {type(err).__name__}"
print(json.dumps(info))
PY
MACHINE=${MACHINE:-$(python3 bench/gpu_tables.py machine --results "$RESULTS")}
