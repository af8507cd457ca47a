#!/usr/bin/env bash
# Stop the cluster tools/slurm/start.sh started: slurmctld and both slurmd (scontrol shutdown), then munged.
set -uo pipefail
SLURM_DIR=${SLURM_DIR:-/tmp/meshformer-slurm}
PATH=$PATH:/usr/sbin
scontrol shutdown 2>/dev/null || true
for pidfile in "$SLURM_DIR"/slurmctld.pid "$SLURM_DIR"/slurmd-node1.pid "$SLURM_DIR"/slurmd-node2.pid; do
  [ -s "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  if kill -0 "$pid" 2>/dev/null; then kill "$pid"; fi  # did not follow scontrol shutdown
done
if [ -s /run/munge/munged.pid ]; then kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true; fi
echo "slurm: stopped"
