"""Shared pieces of the step benchmarks: model shapes, a Trainer fed from memory, synchronised timing."""

from __future__ import annotations

import gc
import json
import tempfile
import time
from collections.abc import Callable, Iterator

import torch

from meshformer.config import Config, load_config
from meshformer.train.trainer import Trainer

# name: (layers, d_model, heads, seq_len, vocab, batch) for GPT-2-style shapes
GPT_SHAPES = {
    "tiny": (2, 64, 2, 64, 4096, 4),
    "S": (4, 256, 4, 256, 4096, 16),
    "M": (6, 512, 8, 512, 4096, 8),
    "G": (12, 768, 12, 256, 50304, 8),
    "gpt2-xl": (48, 1600, 25, 1024, 50304, 8),
}
# Llama-style (RMSNorm, SwiGLU, RoPE, GQA, no biases): (layers, d_model, heads, kv_heads, d_ff, seq, vocab, batch)
LLAMA_SHAPES = {
    "tiny-llama": (2, 64, 4, 2, 128, 64, 4096, 4),
    "llama-1b": (16, 2048, 32, 8, 8192, 2048, 128256, 4),
    # Llama-3-8B layers (the head kept small so the float8 projections dominate the step).
    "llama8b-layers": (4, 4096, 32, 8, 14336, 2048, 4096, 4),
}


def shape_overrides(shape: str, batch: int | None = None) -> list[str]:
    """Config overrides (on configs/tiny-gpt.toml) that give the named model and batch shape."""
    if shape in GPT_SHAPES:
        n_layer, d, heads, seq, vocab, default_batch = GPT_SHAPES[shape]
        model = [f"model.n_layers={n_layer}", f"model.d_model={d}", f"model.attention.n_heads={heads}",
                 f"model.ffn.d_ff={4 * d}",
                 f"model.vocab_size={vocab}", "model.ffn.activation=gelu", "model.norm.kind=layernorm",
                 "model.position=learned",
                 "model.bias=true", "model.tie_embeddings=true"]
    elif shape in LLAMA_SHAPES:
        n_layer, d, heads, kv, d_ff, seq, vocab, default_batch = LLAMA_SHAPES[shape]
        model = [f"model.n_layers={n_layer}", f"model.d_model={d}", f"model.attention.n_heads={heads}",
                 f"model.attention.n_kv_heads={kv}", f"model.ffn.d_ff={d_ff}", f"model.vocab_size={vocab}",
                 "model.ffn.activation=swiglu",
                 "model.norm.kind=rmsnorm", "model.position=rope", "model.rope.theta=500000.0", "model.bias=false",
                 "model.tie_embeddings=true"]
    else:
        raise SystemExit(f"unknown shape {shape!r}; choose from {[*GPT_SHAPES, *LLAMA_SHAPES]}")
    b = batch or default_batch
    return [*model, f"model.max_seq_len={seq}", "model.dropout=0.0", f"data.seq_len={seq}", f"data.batch_size={b}"]


def bench_config(shape: str, *, dtype: str, device: str, compile: str = "off", loss: str = "auto", fp8: str = "off",
                 batch: int | None = None, extra: list[str] | None = None) -> Config:
    """A run config for `shape` that does no checkpointing, evaluation, sampling or TensorBoard."""
    overrides = [
        *shape_overrides(shape, batch), f"train.dtype={dtype}", f"train.device={device}", f"train.loss={loss}",
        f"train.fp8={fp8}", "train.grad_accum=1", "train.eval_interval=0", "train.sample_interval=0",
        "train.steps=1000000", "checkpoint.interval=0", "checkpoint.resume=false", "logging.tensorboard=false",
        "optim.lr=6e-4", "optim.betas=[0.9, 0.95]", "optim.weight_decay=0.1", "optim.grad_clip=1.0",
        f"logging.run_dir={tempfile.mkdtemp(prefix='bench-')}", *(extra or []),
    ]
    cfg = load_config("configs/tiny-gpt.toml", overrides)
    cfg.train.compile = {"off": False, "blocks": "blocks", "model": "model"}[compile]
    return cfg


class MemoryBatches:
    """Endless random windows of an in-memory token stream, already on the device (no data workers)."""

    def __init__(self, tokens: torch.Tensor, batch: int, seq: int, seed: int = 0) -> None:
        self.tokens, self.batch, self.seq = tokens, batch, seq
        self.gen = torch.Generator().manual_seed(seed)

    def xy(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.tokens) - self.seq - 1, (self.batch,), generator=self.gen)
        window = torch.stack([self.tokens[s : s + self.seq + 1] for s in starts.tolist()])
        return window[:, :-1], window[:, 1:]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        x, y = self.xy()
        return {"input_ids": x, "labels": y}


def random_tokens(vocab: int, device: torch.device, n: int = 1 << 20) -> torch.Tensor:
    return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(0)).to(device)


def corpus_tokens(trainer: Trainer, n_batches: int = 64) -> torch.Tensor:
    """Real text (the configured corpus) as one token stream on the trainer's device."""
    batches = iter(trainer.train_data)
    stream = torch.cat([next(batches)["input_ids"].flatten() for _ in range(n_batches)])
    trainer.train_data.close() if hasattr(trainer.train_data, "close") else None
    return stream.to(trainer.device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable[[], object], steps: int, device: torch.device, clock: str = "wall") -> float:
    """Seconds per step over `steps` calls, synchronised on CUDA.

    clock="cpu": this process's CPU time instead of wall time (CPU only). With one thread
    (torch.set_num_threads(1)) it counts only the work done, so it stays comparable on a loaded machine,
    where wall time also counts the time other processes held the cores.
    """
    read = time.process_time if clock == "cpu" else time.perf_counter
    sync(device)
    start = read()
    for _ in range(steps):
        step()
    sync(device)
    return (read() - start) / steps


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)
