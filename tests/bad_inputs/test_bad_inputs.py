"""Bad inputs a user would hit, as a table: each ends in one line `error: <what> — <fix>`, a non-zero exit and no
traceback, before any work is done, and leaves every checkpoint and shard that existed before it untouched.

Cases run in-process through `meshformer.cli.main` (SystemExit carries the line Python would print); a few
subprocess runs prove the same end to end, and one torchrun job that only one rank reports.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from helpers.common import ROOT
from helpers.convert import SHARD, convert_case_files, indexed
from helpers.data import forge_shard, shards, small_corpus, tar_member
from helpers.one_line import assert_one_line, run_main
from safetensors.torch import load_file

from meshformer.checkpointing.weights import write_weights
from meshformer.cli import main
from meshformer.config import AttentionConfig, FfnConfig, ModelConfig
from meshformer.data import prepare
from meshformer.errors import MeshformerError, run_command
from meshformer.model import Transformer
from meshformer.runtime.run_lock import run_folder_lock

CFG = "configs/tiny-gpt.toml"
TINY = ["model.d_model=32", "model.n_layers=1", "model.ffn.d_ff=64", "data.seq_len=32", "model.max_seq_len=64",
        "train.steps=2", "train.eval_interval=0", "train.sample_interval=0", "logging.tensorboard=false",
        "data.num_workers=0", "checkpoint.interval=1"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A trained run (checkpoints + final weights), prepared shards, a corpus, and files for the bad cases."""
    root = tmp_path_factory.mktemp("bad_inputs")
    run = root / "run"
    main(["train", CFG, "--set", *TINY, f"logging.run_dir={run}", f"data.shards={shards(root)}"])
    paths = {"run": run, "final": run / "final", "ckpt": run / "checkpoints", "shards": shards(root),
             "corpus": small_corpus(root / "corpus", 6), "tmp": root / "scratch", "root": root}
    tmp = paths["tmp"]
    tmp.mkdir()
    (tmp / "afile").write_text("x")
    # files for the cli/config cases (#25)
    good = {"rank": 0, "world_size": 2, "host": "a", "pid": 1, "step": 3, "phase": "data", "seconds_in_phase": 40.0,
            "collectives_issued": 9, "reason": "no progress"}
    for name, text in {"hang-badjson": "{not json", "hang-list": "[1, 2]",
                       "hang-no-step": json.dumps({**good, "step": "three"}),
                       "hang-rank-range": json.dumps({**good, "rank": 5}),
                       "hang-huge-world": json.dumps({**good, "world_size": 10**12})}.items():
        (tmp / name / "diagnostics").mkdir(parents=True)
        (tmp / name / "diagnostics" / "hang-rank0.json").write_text(text)
    (tmp / "bad.toml").write_text("[model\nd_model = 4\n")
    (tmp / "task.yaml").write_text("task: t\ndataset_path: json\noutput_type: multiple_choice\n"
                                   "process_results: !function utils.process_results\n")
    task = ("task: t\ndataset_path: json\noutput_type: multiple_choice\ntest_split: test\ndoc_to_choice: o\n"
            "doc_to_target: i\ndataset_kwargs:\n  data_files:\n    test: {data}\ndoc_to_text: {text}\n")
    (tmp / "docs.jsonl").write_text('{"q": "a", "o": ["x", "y"], "i": 0}\n')
    (tmp / "task-code.yaml").write_text(task.format(
        data="docs.jsonl", text=f'"{{{{ cycler.__init__.__globals__.os.popen(\'touch {tmp}/popen-ran\').read() }}}}"'))
    (tmp / "task-passwd.yaml").write_text(task.format(data="/etc/passwd", text="q"))
    (tmp / "empty.txt").write_text("")
    (tmp / "binary.txt").write_bytes(bytes(range(256)) * 64)
    (tmp / "utf16.txt").write_bytes("In the beginning was the word. ".encode("utf-16") * 50)
    (tmp / "notgz.txt.gz").write_bytes(b"this is not gzip data at all")
    (tmp / "nofield.jsonl").write_text('{"body": "some text"}\n')
    (tmp / "badjson.jsonl").write_text('{"text": "unterminated\n')
    (tmp / "surrogate.jsonl").write_text('{"text": "fine words"}\n{"text": "half a pair \\ud800 here"}\n')
    # files for the data cases (#25)
    (tmp / "late-binary.txt").write_bytes(b"good text\n" * 7000 + b"\x00\x01\x02" * 100)  # past the 64 KiB head
    (tmp / "pretty.jsonl").write_text('[\n  {"text": "one"},\n  {"text": "two"}\n]\n')
    (tmp / "users-folder").mkdir()
    (tmp / "users-folder" / "notes.txt").write_text("not shards")
    (tmp / "p9.work").mkdir()
    (tmp / "p9.work" / "keep.txt").write_text("someone else's")
    (tmp / "corpus-folder").mkdir()
    (tmp / "corpus-folder" / "a.txt").write_text("In the beginning was the word.\n" * 40)
    (tmp / "plain.txt").write_text("a plain text document\n")
    (tmp / "mixed").mkdir()
    (tmp / "mixed" / "a.txt").write_text("good text here\n" * 20)
    (tmp / "mixed" / "b.txt").write_bytes(b"\x00\x01\x02\x03" * 500)
    (tmp / "nothing").mkdir()
    (tmp / "nothing" / "image.png").write_bytes(b"\x89PNG")
    (tmp / "linked-corpus").mkdir()  # (#33) a corpus folder whose file links out of it
    (tmp / "linked-corpus" / "a.txt").write_text("In the beginning was the word.\n" * 40)
    (tmp / "linked-corpus" / "passwd.txt").symlink_to(tmp / "plain.txt")
    (tmp / "unnamed").mkdir()  # (#24) text a folder holds under names that do not say so
    (tmp / "unnamed" / "a.txt").write_text("named text\n")
    (tmp / "unnamed" / "NEWS").write_text("unnamed text\n")
    (tmp / "bytes.tiktoken").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    (tmp / "tok.json").write_text("{not a tokenizer")
    _bad_format_files(tmp)  # (#23)
    # files for the data cases (#24)
    (tmp / "two-files").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp / "two-files" / name).write_text("In the beginning was the word.\n" * 40)
    prepare(tmp / "two-files", tmp / "map-killed", tokenizer="bundled:kjv-bpe-4k", part=(0, 2), stage="map",
            progress=False)  # part 1/2 of the map stage never finished
    # files for the checkpoint/convert cases (#25)
    convert_case_files(tmp)
    final = load_file(paths["final"] / "model.safetensors")  # (#33) its index lacks a tensor the model needs
    indexed(paths["final"], tmp / "final-index-drops", {k: SHARD for k in final if k != "tok_embeddings.weight"})
    (tmp / "broken-weights").mkdir()
    (tmp / "broken-weights" / "model.safetensors").write_bytes(b"garbage")
    (tmp / "broken-weights" / "model_config.json").write_text("{")
    for name, cfg in {"small-vocab": ModelConfig(vocab_size=64, d_model=32, n_layers=1,
                                                 attention=AttentionConfig(n_heads=4), ffn=FfnConfig(d_ff=64)),
                      "encoder": ModelConfig(family="encoder", vocab_size=4096, d_model=32, n_layers=1,
                                             attention=AttentionConfig(n_heads=4), ffn=FfnConfig(d_ff=64))}.items():
        write_weights(Transformer(cfg).state_dict(), cfg, tmp / name)
    # files for the run folder cases (#25)
    (tmp / "runs" / "foreign" / "final").mkdir(parents=True)
    (tmp / "runs" / "foreign" / "final" / "notes.txt").write_text("someone else's")
    (tmp / "runs" / "final-file").mkdir(parents=True)
    (tmp / "runs" / "final-file" / "final").write_text("x")
    for name in ("latest-dir", "latest-dangling", "latest-garbage"):  # a damaged `latest` pointer (#24)
        (tmp / "runs" / name / "checkpoints").mkdir(parents=True)
    (tmp / "runs" / "latest-dir" / "checkpoints" / "latest").mkdir()
    (tmp / "runs" / "latest-dangling" / "checkpoints" / "latest").symlink_to(tmp / "gone")
    (tmp / "runs" / "latest-garbage" / "checkpoints" / "latest").write_bytes(b"\x00\xffnot a step")
    paths["busy"] = contextlib.ExitStack()  # held for the module: another run training in {tmp}/runs/busy
    paths["busy"].enter_context(run_folder_lock(tmp / "runs" / "busy", "logging.run_dir"))
    return paths


def _bad_format_files(tmp: Path) -> None:
    """Broken files of the formats corpora ship in (#23): compressed, Parquet, Megatron, token files."""
    import gzip

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import zstandard
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    lines = b"".join(json.dumps({"text": f"document {i} " * 20}).encode() + b"\n" for i in range(400))
    (tmp / "trunc.jsonl.gz").write_bytes(gzip.compress(lines[:2000])[:-30])
    (tmp / "trunc.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines[:2000])[:-30])
    (tmp / "corrupt.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"\xff" * 100)
    frames = [zstandard.ZstdCompressor().compress(lines[i:i + 70000]) for i in range(0, len(lines), 70000)]
    (tmp / "late.jsonl.zst").write_bytes(b"".join(frames)[:-10])  # the head reads whole; the last frame is cut
    pq.write_table(pa.table({"text": ["some text"] * 50}), tmp / "good.parquet", row_group_size=10)
    (tmp / "broken.parquet").write_bytes((tmp / "good.parquet").read_bytes()[:300])
    (tmp / "fake.parquet").write_text("id,text\n1,hello\n")
    pq.write_table(pa.table({"content": ["some text"] * 5}), tmp / "nocol.parquet")
    pq.write_table(pa.table({"src": ["a", "b"], "tgt": [None, "B"]}), tmp / "nullpairs.parquet")
    (tmp / "mt").mkdir()
    builder = IndexedDatasetBuilder(str(tmp / "mt" / "bad.bin"), dtype=np.uint16)
    for doc in ([5, 6, 7], [8, 9], [10, 11, 12, 13]):
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(str(tmp / "mt" / "bad.idx"))
    with open(tmp / "mt" / "bad.bin", "ab") as fh:
        fh.write(b"\0\0")  # a .bin that is not the one the index was written with
    np.array([10, 11, 12, 2, 7, 5000, 2], dtype=np.uint16).tofile(tmp / "big-ids.bin")  # id 2: EOS of kjv-bpe-4k
    (tmp / "tokdir").mkdir()
    (tmp / "tokdir" / "tokenizer_config.json").write_text("{}")


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix != ".lock"}


@pytest.fixture(scope="module")
def protected(world):
    """What must survive every case: the run's checkpoints and final weights, and the prepared shards."""
    before = {key: _digest(world[key]) for key in ("ckpt", "final", "shards")}
    assert before["ckpt"] and before["final"] and before["shards"]
    return before


def _run_dir(name: str) -> str:
    return f"logging.run_dir={{tmp}}/runs/{name}"


def _train(*overrides: str, name: str = "t") -> list[str]:
    return ["train", CFG, "--set", *TINY, _run_dir(name), "data.cache_dir={tmp}/cache", *overrides]


def _corpus(path: str, *more: str) -> list[str]:
    return _train(f"data.corpus={path}", *more)


def _submit(*options: str, overrides: tuple[str, ...] = ()) -> list[str]:
    return ["submit", CFG, "--dry-run", *options, "--set", _run_dir("s"), "checkpoint.interval=10", *overrides]


# (id, argv with {placeholders}, words the line must hold: the problem and the fix)
CASES = [
    # config file, TOML syntax, keys, types, values
    ("config-missing", ["train", "{tmp}/nope.toml"], ["not found", "pass a TOML file"]),
    ("toml-syntax", ["train", "{tmp}/bad.toml"], ["not valid TOML", "fix the line"]),
    ("unknown-key", _train("train.step=3"), ["unknown config key", "did you mean 'train.steps'"]),
    ("unknown-section", _train("trainer.steps=3"), ["trainer", "valid"]),
    ("override-syntax", ["train", CFG, "--set", "train.steps"], ["train.steps", "section.key=value"]),
    ("init-from-not-hf", _train("checkpoint.init_from=runs/x"), ["checkpoint.init_from='runs/x'", "hf:PATH"]),
    ("init-from-no-folder", ["train", CFG, "--init-from", "{tmp}/nope", *_train(name="i")[2:]],
     ["nope has no config.json", "point at a Hugging Face model folder"]),
    ("wrong-type", _train("model.d_model=abc"), ["model.d_model", "must be int"]),
    ("not-a-choice", _train("model.norm.kind=batchnorm"), ["model.norm.kind", "not one of"]),
    ("list-expected", _train("optim.betas=0.9"), ["optim.betas", "must be a list"]),
    ("heads-divide", _train("model.attention.n_heads=5"), ["not divisible", "choose n_heads"]),
    ("kv-heads", _train("model.attention.n_kv_heads=3"), ["n_kv_heads", "must divide"]),
    # experts configured but placed in no block (TINY has 1 layer): the model would train dense in silence
    ("moe-no-moe-block", _train("model.moe.n_experts=4", 'model.mlp_types=["dense"]'),
     ["model.moe.n_experts=4", "no block of the 1-layer decoder stack is MoE", "model.mlp_types"]),
    ("router-bias-dense", _train("model.moe.router_bias=true"), ["model.moe.router_bias=true needs experts",
                                                                 "set model.moe.n_experts"]),
    ("expert-bias-dense", _train("model.moe.expert_linear_bias=true"),
     ["model.moe.expert_linear_bias=true needs experts", "set model.moe.n_experts"]),
    ("swiglu-limit", _train("model.ffn.activation=swiglu_clamped", "model.ffn.swiglu_limit=-1"),
     ["model.ffn.swiglu_limit=-1", "swiglu_limit=7.0"]),
    ("seq-too-long", _train("data.seq_len=128"), ["exceeds model.max_seq_len", "raise model.max_seq_len"]),
    ("steps-zero", _train("train.steps=0"), ["train.steps", "positive"]),
    ("lr-negative", _train("optim.lr=-1"), ["optim.lr", "positive"]),
    ("ckpt-interval-negative", _train("checkpoint.interval=-1"), ["checkpoint.interval=-1", "use a value >= 0"]),
    ("keep-last-negative", _train("checkpoint.keep_last=-2"), ["checkpoint.keep_last", "use a value >= 0"]),
    ("eval-interval-negative", _train("train.eval_interval=-5"), ["train.eval_interval", ">= 0"]),
    ("min-lr-ratio", _train("schedule.min_lr_ratio=2"), ["schedule.min_lr_ratio", "[0, 1]"]),
    ("betas-range", _train("optim.betas=[0.9,1.5]"), ["optim.betas", "e.g. [0.9, 0.95]"]),
    ("dropout-range", _train("model.dropout=1.5"), ["model.dropout", "[0, 1)"]),
    ("objective-family", _train("train.objective=mlm"), ["does not fit model.family", "use one of"]),
    ("noam-warmup", _train("schedule.name=noam", "schedule.warmup_steps=0"), ["noam", "warmup_steps > 0"]),
    ("window-too-big", _train("model.attention.window=100", 'model.layer_types=["sliding_attention"]'),
     ["attention.window", "smaller window"]),
    ("window-pattern-no-window", _train("model.full_attention_every=6"),
     ["model.full_attention_every=6", "needs model.attention.window", "set both"]),
    ("logit-softcap-fused-loss", _train("model.logit_softcap=30", "train.loss=chunked"),
     ["without model.logit_softcap=30.0", "use train.loss='plain'"]),
    ("profile-steps", _train("profile.start_step=1", "profile.steps=0"), ["profile.steps", "e.g."]),
    ("downstream-no-such-task", _train('downstream.tasks=["bundled:arc"]'),
     ["no bundled task 'bundled:arc'", "bundled:kjv_cloze"]),
    ("downstream-task-function", _train('downstream.tasks=["{tmp}/task.yaml"]'),
     ["process_results is !function utils.process_results", "downstream.trust_task_code = true"]),
    ("downstream-template-code", _train('downstream.tasks=["{tmp}/task-code.yaml"]'),
     ["task-code.yaml: doc_to_text reaches Python internals ('__globals__')", "downstream.trust_task_code = true"]),
    ("downstream-data-outside", _train('downstream.tasks=["{tmp}/task-passwd.yaml"]'),
     ["data_files names '/etc/passwd'", "not to the current folder"]),
    ("downstream-max-task-mb", _train('downstream.tasks=["bundled:kjv_cloze"]', "downstream.max_task_mb=0"),
     ["downstream.max_task_mb=0 must be positive"]),
    ("callback-import", _train('callbacks=[{{path="no_such_pkg_for_callbacks.mod:Counter"}}]'),
     ["callbacks[0].path", "cannot import", "PYTHONPATH"]),
    ("no-cuda", _train("train.device=cuda"), ["no CUDA device", "train.device='cpu'"]),
    ("device-garbage", _train("train.device=banana"), ["train.device='banana' is not a device", "'cuda:N'"]),
    ("device-bad-index", _train("train.device=cuda:x"), ["train.device='cuda:x' is not a device", "'cuda:N'"]),
    ("device-meta", _train("train.device=meta"), ["train.device='meta' is not a device", "'auto', 'cpu'"]),
    ("grad-clip-negative", _train("optim.grad_clip=-1"), ["optim.grad_clip", ">= 0"]),
    ("muon-momentum", _train('optim.name="muon"', "optim.muon.momentum=1.0"),
     ["optim.muon.momentum=1.0", "momentum in [0, 1)"]),
    ("qk-clip-sdpa", _train("optim.qk_clip_threshold=100", 'model.attention.backend="flash"'),
     ["model.attention.backend='flash' (an SDPA kernel) never computes", "set model.attention.backend to 'auto'"]),
    ("qk-clip-qk-norm", _train("optim.qk_clip_threshold=100", "model.attention.qk_norm=true"),
     ["optim.qk_clip_threshold with model.attention.qk_norm=true", "drop optim.qk_clip_threshold"]),
    ("qk-clip-negative", _train("optim.qk_clip_threshold=-5"),
     ["optim.qk_clip_threshold=-5.0 must be > 0", "e.g. 100"]),
    # (#25) values
    ("lr-inf", _train("optim.lr=inf"), ["optim.lr=inf is not a finite number", "e.g. the default optim.lr="]),
    ("lr-nan", _train("optim.lr=nan"), ["optim.lr=nan is not a finite number", "give a finite value"]),
    ("betas-nan", _train("optim.betas=[0.9,nan]"), ["optim.betas=[0.9, nan]", "optim.betas=[0.9, 0.95]"]),
    ("clip-inf", _train("optim.grad_clip=inf"), ["optim.grad_clip=inf", "give a finite value"]),
    ("norm-eps-zero", _train("model.norm.eps=0"), ["model.norm.eps must be positive", "model.norm.eps=1e-05"]),
    ("run-dir-empty", _train("logging.run_dir="), ["logging.run_dir is empty", "logging.run_dir=runs/default"]),
    ("tokenizer-empty", _train("data.tokenizer= "), ["data.tokenizer is empty", "give it a value"]),
    ("corpus-empty-path", _train("data.corpus="), ["data.corpus is empty", "data.corpus=bundled:kjv"]),
    # run folder, checkpoint folder, cache, disk space
    ("run-dir-under-file", _train("logging.run_dir={tmp}/afile/run"), ["is a file", "set logging.run_dir"]),
    ("run-dir-is-file", _train("logging.run_dir={tmp}/afile"), ["is a file", "set logging.run_dir"]),
    ("ckpt-dir-under-file", _train("checkpoint.dir={tmp}/afile/ck"), ["is a file", "set checkpoint.dir"]),
    ("ckpt-dir-of-another-run", _train("checkpoint.dir={ckpt}"),
     ["holds step-00000002 of the run in", "not of this run", "checkpoint.resume_other_run=true"]),
    ("ckpt-dir-unwritable", _train("checkpoint.dir=/proc/meshformer-ck"), ["cannot write", "checkpoint.dir"]),
    ("disk-space", _train("model.n_layers=400", "model.d_model=8192", "model.ffn.d_ff=32768"),
     ["no space left", "free disk space"]),
    ("cache-under-file", _corpus("{corpus}", "data.cache_dir={tmp}/afile/cache"), ["shard cache", "data.cache_dir"]),
    # (#25) run folder
    ("run-dir-in-use", _train(name="busy"), ["runs/busy is in use by pid", "on host", "set logging.run_dir"]),
    ("run-dir-in-use-torchrun", ["train", CFG, "--nproc-per-node", "2", *_train(name="busy")[2:]],
     ["is in use by pid", "wait for it to finish"]),
    ("final-foreign", _train(name="foreign"), ["final holds files meshformer did not write", "logging.run_dir"]),
    ("final-is-file", _train(name="final-file"), ["final is a file", "folder"]),
    # (#24) a damaged `latest` pointer: refused before step 1, not at the first save
    ("latest-is-folder", _train(name="latest-dir"), ["checkpoints/latest is not a file", "remove it"]),
    ("latest-dangling", _train(name="latest-dangling"), ["is a link to", "does not exist", "remove it"]),
    ("latest-garbage", _train(name="latest-garbage"), ["should name a step folder", "remove it"]),
    ("compile-yes", _train("train.compile=yes"), ["train.compile = 'yes' is not valid", "'blocks', 'model'"]),
    # corpus
    ("corpus-missing", _corpus("{tmp}/nowhere.txt"), ["does not exist", "pass a file"]),
    ("corpus-empty", _corpus("{tmp}/empty.txt"), ["holds no text", "point data.corpus"]),
    ("corpus-binary", _corpus("{tmp}/binary.txt"), ["binary.txt is not UTF-8 text", "remove it"]),
    ("corpus-utf16", _corpus("{tmp}/utf16.txt"), ["not UTF-8 text", "convert it to UTF-8"]),
    ("corpus-dir-binary", _corpus("{tmp}/mixed"), ["b.txt is not UTF-8 text", "remove it"]),
    ("corpus-dir-no-text", _corpus("{tmp}/nothing"), ["holds no text files", "add text files"]),
    ("corpus-bad-gzip", _corpus("{tmp}/notgz.txt.gz"), ["cannot be read", "repair or remove"]),
    ("jsonl-no-field", _corpus("{tmp}/nofield.jsonl"), ["no string field 'text'", "data.text_field"]),
    ("jsonl-wrong-field", _corpus("{corpus}", "data.text_field=body"), ["no string field 'body'", "text_field"]),
    ("jsonl-bad-json", _corpus("{tmp}/badjson.jsonl"), ["not valid JSON", "fix or remove"]),
    ("jsonl-lone-surrogate", ["data", "prepare", "{tmp}/surrogate.jsonl", "--out", "{tmp}/p-surrogate", "--tokenizer",
                              "bundled:kjv-bpe-4k"],
     ["surrogate.jsonl:2: field 'text' holds a lone UTF-16 surrogate (\\ud800)", "high-low pair"]),
    # (#25) corpus
    ("jsonl-pretty-printed", _corpus("{tmp}/pretty.jsonl"), ["pretty.jsonl:1: not JSONL", "one JSON object per line"]),
    ("mixture-weight-vanishes", _train('data.sources=[{{shards="{shards}", weight=1}}, {{shards="{shards}", '
                                       'weight=0.0001}}]'), ["data.sources[1].weight=0.0001", "scale the weights"]),
    ("mixture-weight-inf", _train('data.sources=[{{shards="{shards}", weight=inf}}]'),
     ["data.sources[0].weight=inf", "finite weight > 0"]),
    ("mixture-same-name", _train('data.sources=[{{shards="{shards}", name="web"}}, {{shards="{shards}", '
                                 'name="web"}}]'), ["both named 'web'", "its own name"]),
    # (#24) mixture weights, prepared shards
    ("mixture-weight-nan", _train('data.sources=[{{shards="{shards}", weight=1}}, {{shards="{shards}", weight=nan}}]'),
     ["data.sources[1].weight=nan is not a positive number", "finite weight > 0"]),
    ("mixture-weight-negative", _train('data.sources=[{{shards="{shards}", weight=-1}}]'),
     ["data.sources[0].weight=-1", "finite weight > 0"]),
    ("mixture-weight-zero", _train('data.sources=[{{shards="{shards}", weight=0}}, {{shards="{shards}"}}]'),
     ["data.sources[0].weight=0", "finite weight > 0"]),
    ("mixture-weight-huge", _train('data.sources=[{{shards="{shards}", weight=1}}, {{shards="{shards}", '
                                   'weight=1e300}}]'), ["repeat only every 1e+300 samples", "simpler ratios"]),
    ("mixture-no-shards", _train("data.sources=[{{weight=2}}]"), ["data.sources[0] names no shards", "set shards ="]),
    # tokenizer
    ("tokenizer-missing", _train("data.tokenizer={tmp}/none.json"), ["neither", "fix data.tokenizer"]),
    ("tokenizer-bundled", _train("data.tokenizer=bundled:nope"), ["no bundled tokenizer", "available"]),
    ("tokenizer-garbage", _train("data.tokenizer={tmp}/tok.json"), ["not a HF tokenizers JSON", "data prepare"]),
    ("tokenizer-vocab", _train("model.vocab_size=100"), ["4096 tokens", "raise model.vocab_size"]),
    # data options and prepared shards
    ("workers-negative", _train("data.num_workers=-1"), ["data.num_workers", ">= 0"]),
    ("eval-fraction", _train("data.eval_fraction=1.5"), ["data.eval_fraction", "[0, 1)"]),
    ("shuffle-shards", _train("data.shuffle_shards=0"), ["data.shuffle_shards", ">= 1"]),
    ("shards-missing", _train("data.shards={tmp}/noshards"), ["manifest", "data prepare"]),
    ("shards-too-short", _train("data.shards={shards}", "data.seq_len=64"), ["33-token records", "--record-len 65"]),
    ("span-too-short", _train("data.shards={shards}", "model.family=encoder_decoder", "data.target_len=2",
                              "data.seq_len=4"), ["span corruption", "raise both"]),
    # data prepare
    ("prepare-missing", ["data", "prepare", "{tmp}/nowhere", "--out", "{tmp}/p1"], ["does not exist", "pass a file"]),
    ("prepare-link-leaves-folder", ["data", "prepare", "{tmp}/linked-corpus", "--out", "{tmp}/p-linked", "--tokenizer",
                                    "bundled:kjv-bpe-4k"],
     ["passwd.txt links to", "plain.txt, outside", "pass --follow-links"]),
    ("corpus-link-leaves-folder", _corpus("{tmp}/linked-corpus"), ["passwd.txt links to", "copy the linked files"]),
    ("prepare-binary", ["data", "prepare", "{tmp}/binary.txt", "--out", "{tmp}/p2"], ["not UTF-8", "remove it"]),
    ("prepare-exists", ["data", "prepare", "{corpus}", "--out", "{shards}", "--tokenizer", "bundled:kjv-bpe-4k"],
     ["already holds prepared shards", "--overwrite"]),
    ("prepare-eval-fraction", ["data", "prepare", "{corpus}", "--out", "{tmp}/p3", "--eval-fraction", "1.5"],
     ["eval_fraction=1.5", "[0, 1)"]),
    ("prepare-seq-len", ["data", "prepare", "{corpus}", "--out", "{tmp}/p4", "--seq-len", "0"],
     ["too short", "--seq-len >= 1"]),
    ("prepare-tokenizer", ["data", "prepare", "{corpus}", "--out", "{tmp}/p5", "--tokenizer", "{tmp}/none.json"],
     ["neither", "tokenizer"]),
    ("prepare-pairs-text", ["data", "prepare", "{tmp}/plain.txt", "--pairs", "--out", "{tmp}/p6", "--tokenizer",
                            "bundled:kjv-bpe-4k"], ["must come from JSONL", "'src'"]),
    ("prepare-pairs-null", ["data", "prepare", "{tmp}/nullpairs.parquet", "--pairs", "--out", "{tmp}/p6n",
                            "--tokenizer", "bundled:kjv-bpe-4k"], ["a null in column 'tgt'", "fill in or drop"]),
    ("prepare-vocab-small", ["data", "prepare", "{corpus}", "--out", "{tmp}/p7", "--vocab-size", "10"],
     ["too small", "at least"]),
    # (#25) data prepare
    ("prepare-part-zero", ["data", "prepare", "{corpus}", "--out", "{tmp}/p8", "--part", "0/0", "--stage", "map"],
     ["--part 0/0 does not exist", "i from 0 to N - 1"]),
    ("prepare-part-negative", ["data", "prepare", "{corpus}", "--out", "{tmp}/p8", "--part", "-1/2", "--stage", "map"],
     ["--part -1/2 does not exist", "i from 0 to N - 1"]),
    ("prepare-late-binary", ["data", "prepare", "{tmp}/late-binary.txt", "--out", "{tmp}/p10", "--quiet",
                             "--tokenizer", "bundled:kjv-bpe-4k"],
     ["late-binary.txt is not UTF-8", "byte offset 70000"]),
    ("prepare-over-users-folder", ["data", "prepare", "{corpus}", "--out", "{tmp}/users-folder"],
     ["users-folder exists and holds files meshformer did not write", "choose another output folder"]),
    ("prepare-into-its-input", ["data", "prepare", "{tmp}/corpus-folder", "--out", "{tmp}/corpus-folder",
                                "--overwrite"], ["overlaps the input", "outside the input"]),
    ("prepare-foreign-work-folder", ["data", "prepare", "{corpus}", "--out", "{tmp}/p9"],
     ["p9.work exists and was not made by meshformer", "move it away"]),
    # (#23) corpora in their real formats, before training and during prepare
    ("corpus-truncated-gzip", _corpus("{tmp}/trunc.jsonl.gz"),
     ["trunc.jsonl.gz: cannot be read", "bytes of text", "repair or remove"]),
    ("corpus-truncated-zstd", _corpus("{tmp}/trunc.jsonl.zst"),
     ["trunc.jsonl.zst: cannot be read", "ends inside a zstd frame", "compressed byte offset", "repair or remove"]),
    ("corpus-corrupt-zstd", _corpus("{tmp}/corrupt.jsonl.zst"),
     ["corrupt.jsonl.zst: cannot be read: corrupt zstd data", "byte offset 0", "recompress"]),
    ("corpus-parquet-unreadable", _corpus("{tmp}/broken.parquet"),
     ["broken.parquet: unreadable Parquet", "repair or remove"]),
    ("corpus-parquet-not-parquet", _corpus("{tmp}/fake.parquet"), ["fake.parquet is not a parquet file", "repair"]),
    ("corpus-parquet-no-column", _corpus("{tmp}/nocol.parquet"),
     ["nocol.parquet: no column 'text' (has ['content'])", "data.text_field"]),
    ("corpus-megatron-mismatch", _corpus("{tmp}/mt/bad"),
     ["bad.idx does not match bad.bin", "byte offset", "preprocess_data.py"]),
    ("tokenizer-tiktoken-unnamed-pattern", _train("data.tokenizer={tmp}/bytes.tiktoken"),
     ["bytes.tiktoken: its name is not one of", "tiktoken:PATTERN:"]),
    ("tokenizer-tiktoken-no-path", _train("data.tokenizer=tiktoken:cl100k_base"),
     ["tiktoken:cl100k_base names no file", "tiktoken:PATTERN:PATH"]),
    ("tokenizer-tiktoken-vocab", _train("data.tokenizer=tiktoken:cl100k:{tmp}/bytes.tiktoken", "model.vocab_size=100"),
     ["257 tokens", "raise model.vocab_size"]),
    ("tokenizer-folder-without-json", _train("data.tokenizer={tmp}/tokdir"),
     ["tokdir holds no tokenizer.json", "save_pretrained"]),
    ("prepare-late-truncated-zstd", ["data", "prepare", "{tmp}/late.jsonl.zst", "--out", "{tmp}/p11", "--quiet",
                                     "--tokenizer", "bundled:kjv-bpe-4k"],
     ["late.jsonl.zst: cannot be read: the file ends inside a zstd frame", "compressed byte offset", "repair"]),
    ("prepare-token-id-too-large", ["data", "prepare", "{tmp}/big-ids.bin", "--out", "{tmp}/p12", "--quiet",
                                    "--tokenizer", "bundled:kjv-bpe-4k"],
     ["big-ids.bin: document 1", "token id 5000", "has 4096 tokens", "pass the tokenizer these ids come from"]),
    ("prepare-megatron-mismatch", ["data", "prepare", "{tmp}/mt/bad.idx", "--out", "{tmp}/p13", "--tokenizer",
                                   "bundled:kjv-bpe-4k"], ["bad.idx does not match bad.bin", "byte offset"]),
    ("prepare-parquet-no-column", ["data", "prepare", "{tmp}/nocol.parquet", "--out", "{tmp}/p14", "--tokenizer",
                                   "bundled:kjv-bpe-4k"], ["no column 'text'", "--text-field"]),
    ("prepare-tokens-need-their-tokenizer", ["data", "prepare", "{tmp}/big-ids.bin", "--out", "{tmp}/p15"],
     ["big-ids.bin holds token ids", "pass it with --tokenizer"]),
    ("prepare-unnamed-text-in-folder", ["data", "prepare", "{tmp}/unnamed", "--out", "{tmp}/p16"],
     ["1 file(s) hold text but are not named as a corpus format", "NEWS", "--include GLOB"]),
    # parallel layout and launch options
    ("launch-nproc-zero", ["train", CFG, "--nproc-per-node", "0"], ["--nproc-per-node=0", "use --nproc-per-node >= 1"]),
    ("launch-restarts", ["train", CFG, "--max-restarts", "-1"], ["--max-restarts=-1", ">= 0"]),
    ("launch-rdzv-port", ["train", CFG, "--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", "host:abc"],
     ["--rdzv-endpoint='host:abc' is not HOST:PORT", "--rdzv-endpoint node0:29500"]),
    ("launch-rdzv-host", ["train", CFG, "--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint",
                          "no-such-host.invalid:29500"], ["cannot resolve 'no-such-host.invalid'", "first node's"]),
    ("layout-tp", ["train", CFG, "--nproc-per-node", "2", "--set", "parallel.tp=3"], ["does not divide", "choose"]),
    ("layout-cp-family", ["train", "tiny-t5", "--nproc-per-node", "2", "--set", "parallel.cp=2"],
     ["context parallel is implemented for decoder-only and encoder-only", "set parallel.cp=1"]),
    ("layout-pp-layers", ["train", CFG, "--nproc-per-node", "4", "--set", "parallel.pp=4", "model.n_layers=2"],
     ["at least one layer", "lower parallel.pp"]),
    ("layout-pp-batch", ["train", CFG, "--nproc-per-node", "2", "--set", "parallel.pp=2", "data.batch_size=3"],
     ["data.batch_size=3 does not split into the 2 pipeline microbatches", "a multiple of 2"]),
    ("layout-dp-shard", _train("parallel.dp_shard=0"), ["parallel.dp_shard", ">= 1 or -1"]),
    ("layout-expert-shards", ["train", "gpt-oss-120b", "--nnodes", "64", "--nproc-per-node", "8", "--set",
                              "parallel.ep=4"], ["experts.gate_proj (32, 2880, 2880)", "parallel.ep in [1, 8, 16"]),
    ("plan-world-zero", ["plan", CFG, "--world", "0"], ["--world gives 0 ranks", "from 1 to"]),
    ("plan-moe-imbalance", ["plan", CFG, "--world", "2", "--moe-imbalance", "0.5"],
     ["--moe-imbalance 0.5 is below 1", "--moe-imbalance 1.5"]),
    ("plan-moe-imbalance-nan", ["plan", CFG, "--world", "2", "--moe-imbalance", "nan"],
     ["--moe-imbalance nan is not a finite number", "--moe-imbalance 1.5"]),
    ("plan-moe-imbalance-inf", ["plan", CFG, "--world", "2", "--moe-imbalance", "inf"],
     ["--moe-imbalance inf is not a finite number", "--moe-imbalance 1.5"]),
    ("plan-layers-huge", ["plan", CFG, "--world", "2", "--set", "model.n_layers=100000000"],
     ["the model has 100000000 layers", "at most 1024", "model.n_layers"]),
    ("plan-top-zero", ["plan", CFG, "--world", "2", "--top", "0"], ["--top 0 lists no layout", "--top 5"]),
    ("plan-top-negative", ["plan", CFG, "--world", "2", "--top", "-1"], ["--top -1 lists no layout", "--top 5"]),
    ("plan-layout", ["plan", CFG, "--world", "2", "--set", "parallel.tp=3"], ["does not divide", "choose"]),
    ("plan-compiled-full-recompute", ["plan", CFG, "--world", "2", "--set", "train.compile=true", "parallel.tp=2",
                                      "parallel.recompute=full"],
     ["train.compile and tensor", "recompute='selective'"]),
    ("plan-gpu", ["plan", CFG, "--world", "2", "--gpu", "nope"], ["invalid choice", "--help"]),
    ("plan-expert-shards", ["plan", "gpt-oss-120b", "--world", "512", "--set", "parallel.ep=4"],
     ["experts.gate_proj (32, 2880, 2880)", "2880 % 128 != 0", "choose parallel.ep in [1, 8, 16, 32, 64, 128]"]),
    # (#25) planner
    ("plan-world-huge", ["plan", CFG, "--world", "100000000"], ["--world gives 100000000 ranks", "from 1 to"]),
    ("launch-nproc-huge", ["train", CFG, "--nproc-per-node", "100000"], ["--nproc-per-node=100000", "at most 1024"]),
    ("launch-world-huge", ["train", CFG, "--nproc-per-node", "1024", "--nnodes", "100000"],
     ["--nproc-per-node x --nnodes gives 102400000 ranks", "from 1 to"]),
    # submit
    ("submit-nproc-zero", _submit("--nproc-per-node", "0"), ["--nproc-per-node (0)", "fix those options"]),
    ("submit-nodes-zero", _submit("--nodes", "0"), ["--nodes (0)", "must be >= 1"]),
    ("submit-signal", _submit("--signal-before", "-5"), ["--signal-before=-5", "--signal-before >= 0"]),
    ("submit-restarts", _submit("--max-restarts", "-1"), ["--max-restarts=-1", "--max-restarts >= 0"]),
    ("submit-cpus", _submit("--cpus-per-task", "0"), ["--cpus-per-task=0", "--cpus-per-task >= 1"]),
    ("submit-gpus-shared", _submit("--gpus-per-node", "4", "--nproc-per-node", "8"), ["share", "one rank per GPU"]),
    ("submit-layout", _submit("--nodes", "2", "--nproc-per-node", "3", overrides=("parallel.tp=4",)),
     ["does not divide the world size 6", "choose"]),
    ("submit-config", _submit(overrides=("train.step=5",)), ["unknown config key", "did you mean"]),
    # (#25) submit
    ("submit-nodes-huge", _submit("--nodes", "1000000", "--nproc-per-node", "8"),
     ["--nodes x --nproc-per-node gives 8000000 ranks", "from 1 to"]),
    ("submit-replica-split", _submit("--nodes", "3", "--replica-groups", "2"),
     ["--nodes=3 does not split into --replica-groups=2", "multiple of 2, e.g. --nodes 2"]),
    ("submit-replica-one", _submit("--replica-groups", "1"), ["--replica-groups=1 leaves no group", "2 or more"]),
    ("submit-replica-lighthouse", _submit("--nodes", "2", "--replica-groups", "2",
                                          overrides=("fault_tolerance.lighthouse=http://h:1",)),
     ["the job starts its own Lighthouse", "leave fault_tolerance.lighthouse empty"]),
    # the layout is a group's: 1 node x 3 ranks, which tp=2 does not divide (the 6 ranks of both groups it would)
    ("submit-replica-layout", _submit("--nodes", "2", "--nproc-per-node", "3", "--replica-groups", "2",
                                      overrides=("parallel.tp=2",)), ["does not divide the world size 3", "choose"]),
    ("submit-time", _submit("--time", "yesterday"), ["--time 'yesterday' is not a SLURM time limit", "HH:MM:SS"]),
    ("submit-time-hours", _submit("--time", "4h"), ["--time '4h'", "e.g. --time 04:00:00"]),
    ("submit-mem", _submit("--mem", "lots"), ["--mem 'lots' is not a SLURM memory size", "e.g. --mem 200G"]),
    ("submit-partition-newline", _submit("--partition", "gpu\nrm -rf ~"),
     ["--partition 'gpu\\nrm -rf ~'", "choose a --partition without them"]),
    ("submit-job-name-quote", _submit("--job-name", 'a"b'), ["--job-name", "#SBATCH line cannot carry"]),
    ("submit-account-space", _submit("--account", "my lab"), ["--account 'my lab'", "without them"]),
    ("submit-sbatch-arg", _submit("--sbatch-arg=--exclusive\necho pwned"), ["--sbatch-arg", "one option per"]),
    # convert / import / verify
    ("convert-missing", ["convert", "to-safetensors", "{tmp}/nock", "{tmp}/out1"], ["nock", "check"]),
    ("convert-no-weights", ["convert", "to-checkpoint", "{tmp}/nothing", "{tmp}/out2"],
     ["holds no model.safetensors", "final/"]),
    ("convert-broken-weights", ["convert", "export-hf", "{tmp}/broken-weights", "{tmp}/out3"],
     ["not a readable weights folder", "re-export"]),
    ("convert-arch", ["convert", "export-hf", "{final}", "{tmp}/out4", "--arch", "bert"],
     ["cannot be expressed as bert", "choose another --arch"]),
    ("verify-empty", ["convert", "verify", "{tmp}/nothing"], ["no committed checkpoints", "pass a checkpoint.dir"]),
    ("import-hf-missing", ["convert", "import-hf", "{tmp}/nothing", "{tmp}/out5"], ["config.json", "nothing"]),
    ("import-megatron-missing", ["convert", "import-megatron", "{tmp}/nothing", "{tmp}/out6", "--heads", "4"],
     ["nothing", "Megatron"]),
    ("export-megatron-encoder", ["convert", "export-megatron", "{tmp}/encoder", "{tmp}/out7"],
     ["family='encoder'", "export-hf"]),
    # (#25) convert / import
    ("convert-out-is-input", ["convert", "export-hf", "{tmp}/cv-weights", "{tmp}/cv-weights"],
     ["overlaps the input", "outside the input"]),
    ("convert-out-inside-input", ["convert", "import-hf", "{tmp}/cv-hf", "{tmp}/cv-hf/sub", "--overwrite"],
     ["overlaps the input", "outside the input"]),
    ("convert-over-user-files", ["convert", "to-safetensors", "{ckpt}", "{tmp}/cv-user"],
     ["cv-user exists and holds files meshformer did not write", "choose another output folder"]),
    ("export-megatron-over-user-files", ["convert", "export-megatron", "{tmp}/cv-weights", "{tmp}/cv-user"],
     ["meshformer did not write", "--overwrite"]),
    ("convert-shard-size-zero", ["convert", "import-hf", "{tmp}/cv-hf", "{tmp}/cv-o1", "--max-shard-size", "0"],
     ["--max-shard-size", "not a positive size"]),
    ("index-outside", ["convert", "to-checkpoint", "{tmp}/cv-index-outside", "{tmp}/cv-o2"],
     ["'../cv-elsewhere.safetensors', which leaves its folder", "re-export"]),
    ("index-absolute", ["convert", "export-hf", "{tmp}/cv-index-absolute", "{tmp}/cv-o3"],
     ["not a file inside its folder", "re-export"]),
    ("hf-index-outside", ["convert", "import-hf", "{tmp}/cv-hf-outside", "{tmp}/cv-o4"],
     ["model.safetensors.index.json names '../cv-hf-elsewhere.safetensors'", "copy it again"]),
    ("index-missing-tensor", ["convert", "export-hf", "{tmp}/cv-index-drops", "{tmp}/cv-o5"],
     ["index.json has no tensor 'tok_embeddings.weight'", "re-export"]),
    ("index-tensor-not-in-file", ["convert", "export-megatron", "{tmp}/cv-index-lies", "{tmp}/cv-o6"],
     ["'tok_embeddings.weight' in", "model-00001-of-00001.safetensors, which does not hold it", "re-export"]),
    ("import-hf-linked-weights", ["convert", "import-hf", "{tmp}/cv-hf-linked", "{tmp}/cv-o21"],
     ["cv-hf-linked/model.safetensors links to", "cv-hf-elsewhere.safetensors, outside", "--follow-links"]),
    ("import-hf-rope-factor", ["convert", "import-hf", "{tmp}/cv-rope-hf-factor", "{tmp}/cv-o22"],
     ["cv-rope-hf-factor/config.json", "rope_parameters.factor=-8.0 is not a number >= 1",
      "fix that value in config.json"]),
    ("import-hf-rope-factor-nan", ["convert", "import-hf", "{tmp}/cv-rope-hf-nan", "{tmp}/cv-o23"],
     ["rope_parameters.factor=nan is not a number >= 1", "fix that value in config.json"]),
    ("import-hf-rope-theta-zero", ["convert", "import-hf", "{tmp}/cv-rope-hf-theta", "{tmp}/cv-o24"],
     ["rope_parameters.rope_theta=0.0 is not a positive number", "fix that value in config.json"]),
    ("import-hf-top-k-above-experts", ["convert", "import-hf", "{tmp}/cv-moe-hf-top-k", "{tmp}/cv-o25"],
     ["model.moe.experts_per_token=8 must lie in [1, model.moe.n_experts=4]", "fix that value in config.json"]),
    ("import-hf-quantized", ["convert", "import-hf", "{tmp}/cv-gpt-oss-mxfp4", "{tmp}/cv-o40"],
     ["experts.down_proj_blocks: the experts are stored quantized", "add quantization_config", "mxfp4"]),
    ("import-hf-fp8-blocks", ["convert", "import-hf", "{tmp}/cv-deepseek-fp8", "{tmp}/cv-o41"],
     ["weight_scale_inv: the weights are stored in FP8 blocks", "add quantization_config", "fp8"]),
    ("import-hf-truncated", ["convert", "import-hf", "{tmp}/cv-hf-truncated", "{tmp}/cv-o26"],
     ["cv-hf-truncated/model.safetensors is not a readable safetensors file", "download it again"]),
    ("import-hf-header-lies", ["convert", "import-hf", "{tmp}/cv-hf-header-lies", "{tmp}/cv-o27"],
     ["cv-hf-header-lies/model.safetensors is not a readable safetensors file", "header too large", "again"]),
    ("import-hf-pickle-runs-code", ["convert", "import-hf", "{tmp}/cv-hf-pickle", "{tmp}/cv-o28"],
     ["cv-hf-pickle/pytorch_model.bin is not a plain file of tensors", "print", "model.safetensors instead"]),
    ("generate-index-lacks-tensor", ["generate", "{tmp}/final-index-drops", "--prompt", "x"],
     ["model.safetensors.index.json has no tensor 'tok_embeddings.weight'", "model_config.json",
      "re-export the folder"]),
    ("import-hf-zero-heads", ["convert", "import-hf", "{tmp}/cv-hf-zero-heads", "{tmp}/cv-o7"],
     ["config.json: n_head=0 is not a positive integer", "fix that value"]),
    ("import-hf-zero-width", ["convert", "import-hf", "{tmp}/cv-hf-zero-width", "{tmp}/cv-o8"],
     ["n_embd=0 is not a positive integer", "fix that value"]),
    ("import-hf-list", ["convert", "import-hf", "{tmp}/cv-hf-list", "{tmp}/cv-o9"],
     ["n_layer=[2] is not a positive integer", "config.json"]),
    ("import-hf-string", ["convert", "import-hf", "{tmp}/cv-hf-string", "{tmp}/cv-o10"],
     ["n_embd='32' is not a positive integer", "config.json"]),
    ("import-hf-eps-string", ["convert", "import-hf", "{tmp}/cv-hf-eps-string", "{tmp}/cv-o11"],
     ["layer_norm_epsilon='small' is not a positive number", "fix that value in config.json"]),
    ("import-hf-heads-divide", ["convert", "import-hf", "{tmp}/cv-hf-heads-divide", "{tmp}/cv-o12"],
     ["n_embd=32 is not divisible by n_head=5", "config.json"]),
    ("export-hf-moe-as-llama", ["convert", "export-hf", "{tmp}/cv-moe-weights", "{tmp}/cv-o15", "--arch", "llama"],
     ["cannot be expressed as llama", "moe=True", "choose another --arch"]),
    ("export-hf-qk-norm-as-mixtral", ["convert", "export-hf", "{tmp}/cv-moe-weights", "{tmp}/cv-o16", "--arch",
                                      "mixtral"], ["cannot be expressed as mixtral", "qk_norm=True", "--arch"]),
    ("export-hf-gemma3-scaled-local-rope", ["convert", "export-hf", "{tmp}/cv-gemma-scaled-weights", "{tmp}/cv-o20",
                                            "--arch", "gemma3_text"],
     ["cannot be expressed as gemma3_text", "windowed_blocks_rope='scaled", "--arch"]),
    ("export-hf-dense-as-mixtral", ["convert", "export-hf", "{tmp}/cv-weights", "{tmp}/cv-o17", "--arch", "mixtral"],
     ["cannot be expressed as mixtral", "moe=False", "--arch"]),
    ("import-hf-dense-block-not-first", ["convert", "import-hf", "{tmp}/cv-moe-hf-dense-last", "{tmp}/cv-o18"],
     ["qwen3_moe: mlp_only_layers=[1] makes blocks other than the first ones dense", "only checkpoints without it"]),
    ("import-hf-olmoe-clip-qkv", ["convert", "import-hf", "{tmp}/cv-olmoe-hf-clip", "{tmp}/cv-o21"],
     ["olmoe: clip_qkv=8.0 clamps the query / key / value projections", "only checkpoints without it"]),
    ("import-megatron-heads-zero", ["convert", "import-megatron", "{tmp}/cv-mc", "{tmp}/cv-o13", "--heads", "0"],
     ["--heads", ">= 1"]),
    ("import-megatron-outside", ["convert", "import-megatron", "{tmp}/cv-mc-outside", "{tmp}/cv-o14"],
     ["iter_0000000/.metadata names '../../cv-mc/", "leaves its folder"]),
    ("import-megatron-extra-tensor", ["convert", "import-megatron", "{tmp}/cv-mc-extra", "{tmp}/cv-o19"],
     ["no meshformer counterpart", "mtp.layers.0.enorm.weight", "only Megatron-Core GPT models"]),
    # an existing run's checkpoints and weights: refused, untouched
    ("import-into-run", ["convert", "to-checkpoint", "{final}", "{ckpt}"],
     ["already holds checkpoints", "empty folder"]),
    ("export-over-weights", ["convert", "to-safetensors", "{ckpt}", "{final}"], ["already holds model weights",
                                                                                  "another output folder"]),
    ("resume-vocab", ["train", CFG, "--set", *TINY, "logging.run_dir={run}", "data.shards={shards}",
                      "model.vocab_size=100"], ["model.vocab_size=100", "raise model.vocab_size"]),
    ("resume-false-over-checkpoints", ["train", CFG, "--set", *TINY, "logging.run_dir={run}", "data.shards={shards}",
                                       "checkpoint.resume=false"], ["checkpoint.resume=false", "move them out"]),
    ("resume-bad-value", ["train", CFG, "--set", *TINY, "logging.run_dir={run}", "checkpoint.keep_last=-1"],
     ["checkpoint.keep_last=-1", ">= 0"]),
    ("resume-ckpt-dir-file", ["train", CFG, "--set", *TINY, "logging.run_dir={run}",
                              "checkpoint.dir={final}/model.safetensors"], ["is a file", "checkpoint.dir"]),
    # generate / attention-map
    ("generate-no-weights", ["generate", "{tmp}/nothing", "--prompt", "x"], ["holds no model.safetensors", "final/"]),
    ("generate-vocab", ["generate", "{tmp}/small-vocab", "--prompt", "x", "--tokenizer", "bundled:kjv-bpe-4k"],
     ["model.vocab_size=64", "--tokenizer"]),
    # (#24) a tokenizer that is not the weights' own: refused even at the same size, one line naming both
    ("generate-no-tokenizer", ["generate", "{tmp}/small-vocab", "--prompt", "x"],
     ["carries no tokenizer.json", "pass --tokenizer"]),
    ("generate-other-tokenizer", ["generate", "{final}", "--prompt", "x", "--tokenizer",
                                  "{tmp}/cv-other-tokenizer.json"],
     ["cv-other-tokenizer.json", "is not the tokenizer the weights in", "set --tokenizer"]),
    ("attention-other-tokenizer", ["attention-map", "{final}", "--text", "x", "--out", "{tmp}/a2.png", "--tokenizer",
                                   "{tmp}/cv-other-tokenizer.json"], ["is not the tokenizer the weights in"]),
    ("grad-report-other-tokenizer", ["grad-report", CFG, "--weights", "{final}", "--set", *TINY,
                                     "data.tokenizer={tmp}/cv-other-tokenizer.json"],
     ["data.tokenizer", "is not the tokenizer the weights in", "set data.tokenizer"]),
    ("export-hf-other-tokenizer", ["convert", "export-hf", "{final}", "{tmp}/hf-other", "--tokenizer",
                                   "{tmp}/cv-other-tokenizer.json"], ["is not the tokenizer the weights in"]),
    # (#24) data prepare: numbers, parts
    *[(f"prepare-{option[2:]}-{value}", ["data", "prepare", "{corpus}", "--out", f"{{tmp}}/p-{option[2:]}-{value}",
                                          option, value], words)
      for option, value, words in [
          ("--bucket-mb", "0", ["--bucket-mb 0 is not a positive size", "--bucket-mb 128"]),
          ("--bucket-mb", "nan", ["--bucket-mb nan is not a positive size", "MB"]),
          ("--bucket-mb", "1e-12", ["into 1", "buckets", "use a larger --bucket-mb"]),
          ("--shard-records", "0", ["--shard-records 0 is out of range", "--shard-records >= 1"]),
          ("--record-len", "0", ["record_len=0 is too short", "--record-len >= 2"]),
          ("--seed", "-1", ["--seed -1 is out of range", "--seed >= 0"]),
          ("--num-proc", "-2", ["--num-proc -2 is out of range", "--num-proc >= 0"]),
          ("--vocab-size", "0", ["--vocab-size 0 is out of range", "--vocab-size >= 1"])]],
    ("submit-prepare-bucket-mb", ["data", "submit-prepare", "{corpus}", "--out", "{tmp}/p10", "--parts", "2",
                                  "--dry-run", "--tokenizer", "bundled:kjv-bpe-4k", "--bucket-mb", "0"],
     ["--bucket-mb 0 is not a positive size", "--bucket-mb 128"]),
    ("merge-after-killed-map", ["data", "prepare", "{tmp}/two-files", "--out", "{tmp}/map-killed", "--stage", "merge",
                                "--part", "0/2", "--tokenizer", "bundled:kjv-bpe-4k"],
     ["1 map task(s)", "b.txt; killed", "rerun the same command with `--stage map --part 1/2`"]),
    ("generate-zero-tokens", ["generate", "{final}", "--prompt", "x", "--max-new-tokens", "0"],
     ["--max-new-tokens=0", "at least 1"]),
    ("generate-too-long", ["generate", "{final}", "--prompt", "x", "--max-new-tokens", "500"],
     ["max_seq_len=64", "max_new_tokens <="]),
    ("generate-prompt-too-long", ["generate", "{final}", "--prompt", "In the beginning " * 40, "--max-new-tokens", "4"],
     ["-token prompt is", "tokens longer than the model's context", "max_seq_len=64",
      "shorten the prompt to at most 61 tokens to generate 4 new ones"]),
    ("generate-encoder", ["generate", "{tmp}/encoder", "--prompt", "x", "--tokenizer", "bundled:kjv-bpe-4k"],
     ["encoder-only", "decoder"]),
    ("generate-tokenizer", ["generate", "{final}", "--prompt", "x", "--tokenizer", "bundled:nope"],
     ["no bundled tokenizer", "available"]),
    ("attention-layer", ["attention-map", "{final}", "--text", "x", "--layer", "9", "--out", "{tmp}/a.png"],
     ["layer 9 does not exist", "layers are"]),
    # monitoring commands
    ("plot-no-events", ["plot", "{tmp}/nothing"], ["no TensorBoard event files", "logging.tensorboard"]),
    ("tensorboard-missing", ["tensorboard", "{tmp}/norun"], ["does not exist", "logging.run_dir"]),
    ("diagnose-none", ["diagnose", "{tmp}/nothing"], ["no hang reports", "nothing to diagnose"]),
    ("diagnose-missing-run", ["diagnose", "{tmp}/norun"], ["run folder", "does not exist", "logging.run_dir"]),
    # (#25) monitoring
    ("tensorboard-port-negative", ["tensorboard", "{run}", "--port", "-1"],
     ["--port -1 is not a TCP port", "1 to 65535"]),
    ("tensorboard-port-big", ["tensorboard", "{run}", "--port", "70000"], ["--port 70000", "0 for any free port"]),
    ("diagnose-bad-json", ["diagnose", "{tmp}/hang-badjson"], ["hang-rank0.json cannot be read as JSON", "remove it"]),
    ("diagnose-not-object", ["diagnose", "{tmp}/hang-list"], ["is not a JSON object", "run diagnose again"]),
    ("diagnose-wrong-field", ["diagnose", "{tmp}/hang-no-step"], ["no valid 'step' field", "remove it"]),
    ("diagnose-rank-range", ["diagnose", "{tmp}/hang-rank-range"], ["names rank 5 of a world of 2", "remove it"]),
    ("diagnose-huge-world", ["diagnose", "{tmp}/hang-huge-world"],
     ["give world_size=1000000000000", "pass the job's --world-size"]),
    ("diagnose-world-flag", ["diagnose", "{tmp}/hang-badjson", "--world-size", "0"], ["--world-size gives 0 ranks",
                                                                                       "from 1 to 262,144"]),
    ("generate-empty-prompt", ["generate", "{final}", "--prompt", ""],
     ["--prompt '' holds no tokens", "pass some text"]),
    # command-line usage
    ("usage-no-command", [], ["required", "--help"]),
    ("usage-unknown-command", ["fly"], ["invalid choice", "--help"]),
    ("usage-missing-config", ["train"], ["train needs a config", "tiny-gpt", "--init-from"]),
    ("continue-hf-without-a-folder", ["train", "continue-hf"], ["has no model of its own", "--init-from"]),
    ("usage-bad-int", ["submit", CFG, "--nodes", "two"], ["invalid int value", "--help"]),
    ("usage-prepare-out", ["data", "prepare", "{corpus}"], ["--out", "--help"]),
    ("usage-convert", ["convert"], ["required", "--help"]),
]


def _fill(argv: list[str], world: dict[str, Path]) -> list[str]:
    return [arg.format(**{k: str(v) for k, v in world.items()}) for arg in argv]


@pytest.mark.parametrize("argv, words", [pytest.param(argv, words, id=name) for name, argv, words in CASES])
def test_bad_input_is_one_clear_line(argv, words, world, protected, capsys, one_thread):
    assert_one_line(run_main(_fill(argv, world), capsys), words)
    for key, digest in protected.items():
        assert _digest(world[key]) == digest, f"{key} changed"


def test_table_covers_the_categories():
    assert len(CASES) >= 60 and len({name for name, _, _ in CASES}) == len(CASES)


def test_unexpected_errors_keep_their_traceback():
    with pytest.raises(ZeroDivisionError):
        run_command(lambda: 1 / 0)
    with pytest.raises(MeshformerError):
        run_command(lambda: (_ for _ in ()).throw(MeshformerError("what", "fix")), debug=True)
    with pytest.raises(SystemExit, match="^error: what — fix$"):
        run_command(lambda: (_ for _ in ()).throw(MeshformerError("what", "fix")))


def test_the_first_failing_rank_reports_and_the_others_stay_quiet(tmp_path, monkeypatch):
    """Ranks of one torchrun attempt share the agent's attempt folder: the first to claim it prints the line."""
    attempt = tmp_path / "attempt_0"
    monkeypatch.setenv("WORLD_SIZE", "2")
    failing = lambda: (_ for _ in ()).throw(MeshformerError("shard x is missing", "restore it"))  # noqa: E731
    for rank, expected in ((1, "error: shard x is missing — restore it"), (0, 1)):  # rank 1 fails first
        (attempt / str(rank)).mkdir(parents=True)
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / str(rank) / "error.json"))
        with pytest.raises(SystemExit) as info:
            run_command(failing)
        assert info.value.code == expected


def test_a_shard_corrupted_on_disk_fails_in_one_line_from_a_loader_worker(world, protected, capsys, one_thread):
    """Found by a DataLoader worker at step 1 (same size, wrong bytes): torch re-raises it wrapped in the worker's
    traceback text; the user still gets the one line, after the run's start-up log."""
    bad = world["tmp"] / "corrupt-shards"
    shutil.copytree(world["shards"], bad)
    for shard in bad.glob("train-*.tar"):
        data = bytearray(shard.read_bytes())
        data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
        shard.write_bytes(bytes(data))
    err = run_main(["train", CFG, "--set", *TINY, f"logging.run_dir={world['tmp'] / 'runs' / 'corrupt'}",
                    f"data.shards={bad}", "data.num_workers=1"], capsys)
    last = err.splitlines()[-1]
    assert "Traceback" not in err and last.startswith("error: shard ") and "corrupt-shards/train-" in last, err
    assert "data.bad_shards='skip'" in last and "worker" not in last
    assert {key: _digest(world[key]) for key in protected} == protected


@pytest.mark.parametrize("case, member, words", [pytest.param(*case, id=case[0]) for case in [
    ("dotdot", "../000000000.tokens.u16", "member '../000000000.tokens.u16' names a path outside the shard"),
    ("absolute", "/000000000.tokens.u16", "member '/000000000.tokens.u16' names a path outside the shard"),
    ("symlink", tar_member("000000000.tokens.u16", tarfile.SYMTYPE, "/etc/passwd"),
     "member '000000000.tokens.u16' is a symbolic link, not a regular file")]])
def test_a_crafted_tar_member_fails_in_one_line(world, protected, capsys, one_thread, case, member, words):
    """(#24) A shard whose member is a link or names a path (index, sha256 and counts forged to match): one line
    naming the shard and the member at step 1, from a loader worker, not a raw `KeyError: 'tokens'`."""
    forged = shutil.copytree(world["shards"], world["tmp"] / f"forged-{case}")
    name = forge_shard(forged, [[member], *([f"{i:09d}.tokens.u16"] for i in (1, 2, 3))])
    err = run_main(["train", CFG, "--set", *TINY, f"logging.run_dir={forged}-run", f"data.shards={forged}",
                    "data.num_workers=1", "data.shuffle_shards=7"], capsys)
    last = err.splitlines()[-1]
    assert "Traceback" not in err and last.startswith(f"error: shard {forged / name}: {words}"), err
    assert "re-run `meshformer data prepare`" in last
    assert {key: _digest(world[key]) for key in protected} == protected


def test_single_file_corpus_gets_an_eval_split(world, tmp_path):
    from meshformer.data import prepare

    one = tmp_path / "one.txt"  # one plain-text file is one document: no document can be held out
    one.write_text("\n\n".join(json.loads(line)["text"] for line in world["corpus"].read_text().splitlines()))
    manifest = prepare(one, tmp_path / "out", tokenizer="bundled:kjv-bpe-4k", record_len=17, eval_fraction=0.1,
                       progress=False)
    train, held = (sum(s.samples for s in manifest.splits[k]) for k in ("train", "eval"))
    assert manifest.meta["documents"] == {"train": 1, "eval": 0} and manifest.meta["eval_held_out"] == "tokens"
    assert held == round((train + held) * 0.1) and held >= 1


# ----------------------------------------------------------------------------- end to end, as a user sees it


def _cli(*args: str, env: dict[str, str] | None = None, module: str = "meshformer.cli") -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=300)


def test_subprocess_prints_one_line_and_exits_non_zero():
    for out in (_cli("train", CFG, "--set", "checkpoint.interval=-1"),
                _cli(CFG, "--set", "checkpoint.interval=-1", module="meshformer.train")):
        assert out.returncode == 1 and out.stderr.startswith("error: checkpoint.interval=-1"), out.stderr
        assert out.stderr.count("\n") == 1


def test_debug_shows_the_traceback(tmp_path, monkeypatch):
    from meshformer.config import ConfigError

    with pytest.raises(ConfigError, match="train.steps"):
        main(["train", CFG, "--debug", "--set", "train.steps=0"])  # --debug anywhere on the line
    monkeypatch.setenv("MESHFORMER_DEBUG", "1")
    with pytest.raises(ConfigError, match="train.steps"):
        main(["train", CFG, "--set", "train.steps=0"])


def test_under_torchrun_one_rank_reports(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", "meshformer.train", CFG, "--set", *TINY, f"logging.run_dir={tmp_path}",
                          "train.steps=0"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert text.count("error: ") == 1, text[-3000:]


def test_wandb_that_cannot_start_online_is_one_line(world, protected, capsys, monkeypatch, one_thread):
    """W&B online without a login or a network: wandb.init raises (its own multi-line text) before step 1."""
    import types

    def init(**kwargs):
        raise RuntimeError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])\n  more lines")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    err = run_main(["train", CFG, "--set", *TINY, f"logging.run_dir={world['tmp'] / 'runs' / 'wandb'}",
                    f"data.shards={world['shards']}", "logging.wandb=true"], capsys)
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: Weights & Biases did not start (logging.wandb_mode=online)") and \
        "logging.wandb_mode=offline" in lines[0], lines[0]
    assert {key: _digest(world[key]) for key in protected} == protected


@pytest.mark.parametrize("env, words", [
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "abc"},
     ["MASTER_ADDR='127.0.0.1' MASTER_PORT='abc' is not HOST:PORT"]),
    ({"MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"}, ["cannot resolve 'no-such-host.invalid'"]),
    ({}, ["WORLD_SIZE=2, but MASTER_ADDR and MASTER_PORT are not both set"]),
], ids=["port", "host", "missing"])
def test_a_rendezvous_without_torchrun_that_cannot_work_is_one_line(world, protected, capsys, monkeypatch, one_thread,
                                                                    tmp_path, env, words):
    """A job started by hand (or a scheduler) with env:// variables: torch raises a traceback for a malformed
    MASTER_PORT and retries an unresolvable MASTER_ADDR until its timeout."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this rank's "already reported" marker goes here
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    err = run_main(["train", CFG, "--set", *TINY, f"logging.run_dir={tmp_path / 'run'}",
                    f"data.shards={world['shards']}"], capsys)
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: ") and "MASTER_PORT" in lines[0] and "--nproc-per-node" in lines[0], lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    assert {key: _digest(world[key]) for key in protected} == protected
