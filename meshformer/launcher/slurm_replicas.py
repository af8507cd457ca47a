"""`meshformer submit CONFIG --replica-groups N`: the fault-tolerant part of the sbatch script.

The allocation's nodes split into N replica groups of whole nodes. The script runs:
- one job step for the torchft Lighthouse (`meshformer lighthouse`) on the first node, sharing it (`--overlap`);
- one job step per group (`srun --relative`: the group's own nodes), each the torchrun command a single job uses,
  with `MESHFORMER_REPLICA_ID=r`, the Lighthouse's address (`TORCHFT_LIGHTHOUSE`) and a rendezvous on the group's
  first node;
- a loop per group that starts its job step again when it fails, without touching the others (which train on):
  the restarted group heals from a live peer at its first step. No group is restarted after a stop signal, after
  another group reached train.steps (nothing would be left to heal from), or after --max-restarts restarts.

`--no-kill` keeps the allocation when a node fails: the other groups train on. A group whose node is gone cannot
start again inside the allocation (SLURM does not replace nodes); it stays out until the job is requeued.
"""

from __future__ import annotations

from meshformer.errors import SubmitError
from meshformer.launcher.replica_groups import check_replica_groups

# Shell text in the commands, resolved on the nodes when the script runs
LIGHTHOUSE_BIND = "@LIGHTHOUSE_BIND@"
GROUP_RDZV_ENDPOINT = '"$GROUP_ADDR:$RDZV_PORT"'  # the group's first node: each group is its own rendezvous
GROUP_RDZV_ID = '"$SLURM_JOB_ID-$r"'


def check_replica_split(groups: int, nodes: int, lighthouse: str) -> int:
    """Nodes per group: whole nodes, the same number for every group; the script starts the run's Lighthouse."""
    check_replica_groups(groups)
    if groups < 2:
        raise SubmitError(f"--replica-groups={groups} leaves no group to train on when one fails",
                          "use --replica-groups 2 or more, or leave it out for a job without fault tolerance")
    if nodes % groups:
        raise SubmitError(f"--nodes={nodes} does not split into --replica-groups={groups} groups of whole nodes",
                          f"use a --nodes that is a multiple of {groups}, "
                          f"e.g. --nodes {groups * max(1, nodes // groups)}")
    if lighthouse:
        raise SubmitError(f"fault_tolerance.lighthouse={lighthouse!r} is set, but the job starts its own Lighthouse "
                          "on its first node", "leave fault_tolerance.lighthouse empty for `submit --replica-groups`")
    return nodes // groups


def replica_groups_launch(groups: int, nodes_per_group: int, max_restarts: int, torchrun: str, lighthouse: str,
                          lighthouse_port: int) -> str:
    """The script's lines that start the Lighthouse and the groups and wait for them (status in $STATUS).

    `torchrun` and `lighthouse` are shell text (quoted, one option a line) holding GROUP_RDZV_ENDPOINT /
    GROUP_RDZV_ID and LIGHTHOUSE_BIND."""
    lighthouse = lighthouse.replace(LIGHTHOUSE_BIND, '"[::]:$LIGHTHOUSE_PORT"')
    return f"""# Fault tolerance: a torchft Lighthouse on the first node, then {groups} replica groups of
# {nodes_per_group} node(s), each its own job step. A failed group is started again (it heals from a live
# peer); the others train on.
LIGHTHOUSE_PORT=$(( {lighthouse_port} + SLURM_JOB_ID % 1000 ))
export TORCHFT_LIGHTHOUSE="http://$HEAD_ADDR:$LIGHTHOUSE_PORT"
STOP_FILE="$JOB_DIR/stopping"  # a stop signal reached the job: no group is restarted
DONE_FILE="$JOB_DIR/finished"  # a group reached train.steps: a failed group has no peer left to heal from
rm -f "$STOP_FILE" "$DONE_FILE"  # a requeued job keeps its id, and its folder
trap 'touch "$STOP_FILE"; on_time_limit' USR1
trap 'touch "$STOP_FILE"; echo "[$(date -Is)] SIGTERM (preemption or scancel): the ranks checkpoint and stop"' TERM

srun --overlap --nodes=1 --ntasks=1 --relative=0 --kill-on-bad-exit=0 --output="$JOB_DIR/lighthouse.log" \\
    --open-mode=append {lighthouse} &
LIGHTHOUSE_PID=$!
for _ in $(seq 120); do  # each group's rank 0 connects to it when it starts
  (exec 3<>"/dev/tcp/$HEAD_ADDR/$LIGHTHOUSE_PORT") 2>/dev/null && break
  kill -0 "$LIGHTHOUSE_PID" 2>/dev/null || {{ echo "[$(date -Is)] the Lighthouse exited: see $JOB_DIR/lighthouse.log"
                                             break; }}
  sleep 1
done
echo "[$(date -Is)] lighthouse: $TORCHFT_LIGHTHOUSE"

run_group() {{  # replica group $1 on its own nodes, started again when it fails
  local r=$1 restarts=0 status first
  trap 'touch "$STOP_FILE"' TERM  # the job step gets the signal too, and saves: this loop only stops restarting
  first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n "$(( r * {nodes_per_group} + 1 ))p")
  GROUP_ADDR=$(scontrol show node "$first" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
  GROUP_ADDR=${{GROUP_ADDR:-$first}}
  while true; do
    echo "[$(date -Is)] replica group $r: starting on {nodes_per_group} node(s) from $first (restart $restarts)"
    MESHFORMER_REPLICA_ID=$r srun --kill-on-bad-exit=1 --nodes={nodes_per_group} --ntasks={nodes_per_group} \\
        --ntasks-per-node=1 --relative=$(( r * {nodes_per_group} )) \\
        --output="$JOB_DIR/group$r-node%n.log" --open-mode=append \\
        {torchrun}
    status=$?
    if [ "$status" = 0 ]; then
      touch "$DONE_FILE"
      echo "[$(date -Is)] replica group $r reached train.steps"
      return 0
    fi
    if [ -e "$STOP_FILE" ]; then why="stopping"
    elif [ -e "$DONE_FILE" ]; then why="the run reached train.steps in another group"
    elif [ "$restarts" -ge {max_restarts} ]; then why="{max_restarts} restarts (--max-restarts)"
    else
      restarts=$(( restarts + 1 ))
      echo "[$(date -Is)] replica group $r exited with status $status; restarting it (restart $restarts):" \\
        "it heals from a live peer"
      continue
    fi
    echo "[$(date -Is)] replica group $r exited with status $status; not restarted ($why)"
    return "$status"
  done
}}

GROUP_PIDS=()
for r in $(seq 0 {groups - 1}); do
  run_group "$r" &
  GROUP_PIDS+=($!)
done
STATUS=0
for pid in "${{GROUP_PIDS[@]}}"; do
  while true; do  # a trapped signal interrupts `wait`: wait again until the group's loop has really ended
    wait "$pid"; GROUP_STATUS=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  [ "$GROUP_STATUS" != 0 ] && STATUS=$GROUP_STATUS
done
# The run reached train.steps in a group: done, whatever the failed groups' last status
[ -e "$DONE_FILE" ] && [ ! -e "$STOP_FILE" ] && STATUS=0
kill "$LIGHTHOUSE_PID" 2>/dev/null
wait "$LIGHTHOUSE_PID" 2>/dev/null
"""
