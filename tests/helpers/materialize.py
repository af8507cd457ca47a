"""Meta-device build checks run inside the parallel harness (scenario names "materialize:family/layout").

For one layout: the single-process model (built eagerly on CPU) and the meta-built, sharded, materialised
model must hold bitwise-equal weights and buffers, and the ranks' live tensor bytes while building must stay
within their own shards plus one full tensor in flight (never the whole model).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created under the mode and still alive (freed ones are subtracted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta and type(t) is torch.Tensor:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._seen:
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def materialize_check(name: str) -> dict[str, Any]:
    from helpers.parallel import build_cpu_plan, new_model, scenario
    from meshformer.checkpointing.weights import quiet_redistribute
    from meshformer.model import Transformer
    from meshformer.model.init import new_seed

    cfg, _ = scenario(name)
    reference = new_model(cfg)
    ref_params = dict(reference.named_parameters())
    ref_buffers = dict(reference.named_buffers())
    torch.manual_seed(cfg.train.seed)
    init_seed = new_seed()  # what Transformer(cfg.model) draws after the same manual_seed
    with torch.device("meta"):
        model = Transformer(cfg.model, init_seed=init_seed)
    tracker = LiveBytes()
    with tracker:
        plan = build_cpu_plan(cfg, model)
    mismatched, checked, local_bytes, largest = [], set(), 0, 0
    for part in plan.model_parts:
        assert isinstance(part, Transformer)  # a whole model or a pipeline stage of one
        seen: set[int] = set()
        for local_name, param in part.named_parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            local_bytes += _local_bytes(param)
            largest = max(largest, param.numel() * param.element_size())
            name_ = part.canonical_name(local_name)
            with quiet_redistribute():
                value = _full(param.detach())  # a collective over the part's mesh: same order on its ranks
            checked.add(name_)
            if not torch.equal(value, ref_params[name_]):
                mismatched.append(name_)
        for local_name, buffer in part.named_buffers():
            local_bytes += _local_bytes(buffer)
            name_ = local_name
            expected = ref_buffers[name_][part.parallel_context.alibi_heads] if name_ == "alibi_slopes" \
                else ref_buffers[name_]
            if not torch.equal(buffer, expected):
                mismatched.append(name_)
    saved_mismatch = _save_round_trip(plan, reference)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (sorted(checked), mismatched, tracker.peak, local_bytes, largest))
    model_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    return {
        "mismatched": sorted(set().union(*(set(g[1]) for g in gathered))),
        "missing": sorted(set(ref_params) - set().union(*(set(g[0]) for g in gathered))
                          - ({"output.weight"} if cfg.model.tie_embeddings else set())),
        # per rank: (peak live bytes while building, local parameter + buffer bytes, largest full parameter bytes)
        "memory": [(g[2], g[3], g[4]) for g in gathered],
        "model_bytes": model_bytes,
        "saved_mismatch": saved_mismatch,
    }


def _save_round_trip(plan, reference) -> list[str] | None:
    """Final weights written from this layout (several small files) read back equal the reference (rank 0)."""
    import tempfile

    from meshformer.checkpointing.weights import read_weights, save_weights

    with tempfile.TemporaryDirectory() as tmp:  # only rank 0 writes, into its own folder
        index = save_weights(plan, tmp, max_shard_size="16KB")
        if index is None:
            return None
        if not index.name.endswith(".index.json"):
            return ["expected several files"]
        _, state = read_weights(tmp)
    expected = reference.state_dict()
    return sorted(set(expected) ^ set(state)) + [k for k in expected if k in state and
                                                  not torch.equal(state[k], expected[k])]
