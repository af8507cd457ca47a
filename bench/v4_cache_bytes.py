"""DeepSeek-V4-Flash's generation cache per token of context against DeepSeek-V3's, as context grows.

Counted from the architectures' cache layouts at transformers 5.24's default configs (DeepseekV4Config: V4-Flash,
DeepseekV3Config: V3), one sequence, 2-byte elements throughout:
- V3 (MLA): every layer keeps kv_lora_rank + qk_rope_head_dim per token.
- V4: what meshformer's cache of each layer's kind holds (`V4AttentionKind.cache_elements`, the config imported
  through the deepseek_v4 adapter): the sliding window's last window - 1 keys (one head of head_dim, keys are
  values); an HCA layer also one head_dim entry per compress-rate-128 window, a CSA layer one head_dim entry and
  one index_head_dim indexer key per rate-4 window; and each compressor's unfinished window (its projections and
  gates, CSA's overlapping halves too).

    python bench/v4_cache_bytes.py [--table PATH --machine TEXT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from tables import add_table_arguments, write_table  # noqa: E402

CONTEXTS = (4096, 32768, 131072, 1048576)
BYTES = 2


def v3_elements(cfg: Any, context: int) -> int:
    return cfg.num_hidden_layers * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def v4_elements(cfg: Any, context: int) -> int:
    from meshformer.checkpointing.hf import config_from_hf
    from meshformer.model.components import TOKEN_MIXERS

    ours = config_from_hf(cfg)
    return sum(TOKEN_MIXERS[kind].cache_elements(ours, context) for kind in ours.layer_types)  # type: ignore[attr-defined]


def rows(v3: Any, v4: Any) -> list[dict[str, float]]:
    return [{"context": t, "v3": v3_elements(v3, t) * BYTES / t, "v4": v4_elements(v4, t) * BYTES / t}
            for t in CONTEXTS]


def table(result: list[dict[str, float]]) -> tuple[list[str], list[list[Any]]]:
    columns = ["context (tokens)", "V3 bytes / token", "V4-Flash bytes / token", "V4 / V3"]
    return columns, [[f"{r['context']:,}", f"{r['v3']:,.0f}", f"{r['v4']:,.0f}", f"{r['v4'] / r['v3']:.3f}"]
                     for r in result]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_table_arguments(parser)
    args = parser.parse_args()
    from transformers import DeepseekV3Config, DeepseekV4Config

    v3, v4 = DeepseekV3Config(), DeepseekV4Config()
    result = rows(v3, v4)
    for r in result:
        print(json.dumps({"bench": "v4_cache_bytes", **r}))
    if args.table:
        columns, cells = table(result)
        kinds = ", ".join(f"{v4.layer_types.count(k)} {k}" for k in dict.fromkeys(v4.layer_types))
        rates = v4.compress_rates
        write_table(args.table, machine=args.machine, page="architectures",
                    title="DeepSeek-V4-Flash's generation cache per token against DeepSeek-V3's",
                    command="python bench/v4_cache_bytes.py",
                    setup=(f"Counted from the cache layouts at transformers' default configs, one sequence, 2-byte "
                           f"elements. V3: {v3.num_hidden_layers} MLA layers of {v3.kv_lora_rank} + "
                           f"{v3.qk_rope_head_dim} per token. V4-Flash: {v4.num_hidden_layers} layers "
                           f"({kinds}), each keeping the last {v4.sliding_window - 1} keys of one {v4.head_dim}-wide "
                           f"head; HCA adds one entry per {rates['heavily_compressed_attention']} tokens, CSA one "
                           f"entry and one {v4.index_head_dim}-wide indexer key per "
                           f"{rates['compressed_sparse_attention']}; each compressor its unfinished window. As "
                           f"meshformer's V4 cache holds them (V4AttentionKind.cache_elements)."),
                    notes=("The sliding windows and the unfinished compression windows are a fixed cost, so V4's "
                           "bytes per token fall as the context grows; "
                           "the published checkpoints store parts of the cache in FP8, which this count does not "
                           "model."),
                    columns=columns, rows=cells)


if __name__ == "__main__":
    main()
