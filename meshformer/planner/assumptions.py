"""What the planner assumes of the hardware and the routing: the devices it fits, their margins, and the MoE load.

A module of constants alone (no torch), so that `meshformer plan --help` lists them without loading the planner.
"""

from __future__ import annotations

GiB = 2**30

DEVICES = {  # usable bytes as the driver reports them
    "h100-80gb": 79.6 * GiB,
    "h200": 139.8 * GiB,
    "a100-80gb": 79.2 * GiB,
    "a100-40gb": 39.4 * GiB,
    "cpu": 24 * GiB,
}
SAFETY_FRACTION = 0.10  # fragmentation and allocator slack
CUDA_CONTEXT = 1.0 * GiB  # CUDA context, cuBLAS / NCCL workspaces

# Rows an expert-parallel rank's experts receive, over the balanced N k: the planning default. Routing at
# initialisation and with balancing on stays near it; plan for more (`--moe-imbalance`) for unbalanced routers, up to
# the dropless worst case (see `activations.moe_rows`), which is ep x the balanced load.
MOE_IMBALANCE = 1.5
