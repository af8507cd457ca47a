#!/usr/bin/env bash
# Start a two-node SLURM cluster on this machine for tests and CI: munged, slurmctld, and two slurmd
# (node1, node2 on ports 6818/6819, both 127.0.0.1). Needs root and Debian's slurmctld slurmd slurm-client
# munge packages; no systemd. Writes /etc/slurm/slurm.conf (only over one this script wrote) and keeps state,
# spool and logs in $SLURM_DIR (default /tmp/meshformer-slurm). Stop with tools/slurm/stop.sh.
set -euo pipefail
SLURM_DIR=${SLURM_DIR:-/tmp/meshformer-slurm}
CONF=/etc/slurm/slurm.conf
MARKER="meshformer local test cluster"
HERE=$(cd "$(dirname "$0")" && pwd)

for tool in munged slurmctld slurmd sinfo; do
  command -v "$tool" >/dev/null || PATH=$PATH:/usr/sbin
  command -v "$tool" >/dev/null || { echo "start.sh: $tool not found; install it with: apt-get install -y" \
    "--no-install-recommends slurmctld slurmd slurm-client munge" >&2; exit 1; }
done
if [ "$(id -u)" != 0 ]; then echo "start.sh: run as root (slurmd and munged need it)" >&2; exit 1; fi
if [ -e "$CONF" ] && ! grep -q "$MARKER" "$CONF"; then
  echo "start.sh: $CONF exists and was not written by this script; refusing to overwrite a real cluster's config" >&2
  exit 1
fi

# munge: the key ships with the Debian package; create one if it is missing.
if [ ! -s /etc/munge/munge.key ]; then mungekey --create --keyfile=/etc/munge/munge.key; chown munge:munge /etc/munge/munge.key; fi
install -d -o munge -g munge -m 0755 /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
fi

# A fresh controller state each start: jobs of an earlier run must not linger.
rm -rf "$SLURM_DIR/state"
mkdir -p "$SLURM_DIR/state" "$SLURM_DIR/spool" "$SLURM_DIR/log" /etc/slurm
sed -e "s|@SLURM_DIR@|$SLURM_DIR|g" -e "s|@CPUS@|$(nproc)|g" "$HERE/slurm.conf.in" > "$CONF"

if ! scontrol ping 2>/dev/null | grep -q UP; then
  slurmctld -i
fi
for node in node1 node2; do
  pidfile="$SLURM_DIR/slurmd-$node.pid"
  if [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then continue; fi
  slurmd -N "$node"
done

# Ready when both nodes are idle (a node left down by an earlier run is resumed).
for _ in $(seq 60); do
  states=$(sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ')
  if [ "$states" = "idle " ]; then
    echo "slurm: node1 and node2 idle (config $CONF, logs $SLURM_DIR/log)"
    exit 0
  fi
  if echo "$states" | grep -qE 'down|drain'; then scontrol update nodename=node[1-2] state=resume 2>/dev/null || true; fi
  sleep 0.5
done
echo "start.sh: nodes not idle after 30 s (states: ${states:-none}); see $SLURM_DIR/log/" >&2
exit 1
