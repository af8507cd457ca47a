"""Continued pretraining from a Hugging Face folder (`checkpoint.init_from = "hf:PATH"`): the first step's loss is
transformers' loss on the same batch, under FSDP x TP too; the final weights export back to the architecture and
load in transformers; a restart resumes from the run's own checkpoints without reading the folder's weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import launch, run_trainer, tiny_shards
from helpers.common import CONFIGS, TESTS
from helpers.hf_models import hf_folder

from meshformer.checkpointing.init_from import resolve_init_from
from meshformer.checkpointing.weights import load_weights
from meshformer.cli import main
from meshformer.config import ConfigError, load_config
from meshformer.data import build_loader, load_tokenizer

transformers = pytest.importorskip("transformers")
LOSS_TOLERANCE = 1e-4  # absolute, fp32: reduction order differs between the layouts and transformers


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return tiny_shards(tmp_path_factory.mktemp("init_from"))


def _overrides(shards: Path, run_dir: Path, folder: Path, steps: int, *extra: str) -> list[str]:
    return [f'data.shards="{shards}"', "data.seq_len=32", "data.batch_size=4", "data.num_workers=0",
            "data.shuffle_shards=2", f"train.steps={steps}", "train.eval_interval=0", "train.sample_interval=0",
            "train.device=cpu", "schedule.warmup_steps=1", "logging.tensorboard=false", "logging.log_interval=1",
            f'logging.run_dir="{run_dir}"', f'checkpoint.init_from="hf:{folder}"', *extra]


def _transformers_loss(hf_model, overrides: list[str], dp_size: int) -> float:
    """transformers' mean token loss on the first step's batches of every data-parallel rank together."""
    cfg = resolve_init_from(load_config(None, overrides))
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    loss_sum, tokens = 0.0, 0
    for dp_rank in range(dp_size):
        batch = next(iter(build_loader(cfg, tokenizer, "train", dp_rank, dp_size)))
        with torch.no_grad():
            logits = hf_model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        labels = batch["labels"]
        loss_sum += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(),
                                                           reduction="sum"))
        tokens += int((labels != -100).sum())
    return loss_sum / tokens


def _check_export(hf_model, run_dir: Path, out: Path) -> None:
    """The final weights export to the same architecture, and transformers computes our logits from them."""
    main(["convert", "export-hf", str(run_dir / "final"), str(out)])
    # config.json: the class, and the folder's own special-token ids (kept through the run's hf_source.json)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [type(hf_model).__name__]
    # the class config.json names (transformers 5.24's auto classes lack some, e.g. mistral4)
    exported = getattr(transformers, written["architectures"][0]).from_pretrained(str(out)).eval()
    assert type(exported) is type(hf_model)
    assert (written["bos_token_id"], written["pad_token_id"]) == (hf_model.config.bos_token_id,
                                                                  hf_model.config.pad_token_id)
    ours = load_weights(run_dir / "final").eval()
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, ours(ids), rtol=0, atol=1e-4)
        moved = max((a - b).abs().max().item() for a, b in zip(exported.state_dict().values(),
                                                                   hf_model.state_dict().values(), strict=True))
    assert moved > 1e-4, "training did not change the weights"


# CI runs one architecture of each kind of block; the rows a cheaper one covers (the same adapter base) are `matrix`
COVERED = {"qwen2": "llama", "mistral": "llama", "qwen3": "llama", "olmo2": "olmo3", "deepseek_v2": "deepseek_v3",
           "glm4_moe": "deepseek_v3", "glm_moe_dsa": "deepseek_v32", "mistral4": "deepseek_v3",
           "olmo_hybrid": "kimi_linear", "nemotron_h": "kimi_linear"}  # recurrent hybrids: kimi_linear's row
# DeepSeek-V4's row (its attention kinds split by heads, hash routing and mHC under tp) is matrix for CI's time: the
# parity rows v4/tp-ep (CI) and v4/tp-fsdp-ep (tests/parity/) check the same layout against one process
MATRIX_ONLY = set(COVERED) | {"deepseek_v4"}


@pytest.mark.slow
@pytest.mark.parametrize("arch", [pytest.param(arch, marks=pytest.mark.matrix) if arch in MATRIX_ONLY else arch
                                  for arch in ["llama", "qwen2", "mistral", "qwen3", "gemma3", "olmo2", "olmo3",
                                               "gpt_oss", "deepseek_v3", "deepseek_v2", "glm4_moe", "kimi_linear",
                                               "deepseek_v32", "glm_moe_dsa", "mistral4", "olmo_hybrid",
                                               "nemotron_h", "deepseek_v4"]])
def test_continued_pretraining_under_fsdp_x_tp(arch, shards, tmp_path):
    hf_model, folder = hf_folder(arch, tmp_path / "hf")
    moe = ("gpt_oss", "deepseek_v3", "deepseek_v2", "glm4_moe", "kimi_linear", "deepseek_v32", "glm_moe_dsa",
           "mistral4", "nemotron_h", "deepseek_v4")
    experts = ["parallel.ep=2"] if arch in moe else []  # tp: ep
    overrides = _overrides(shards, tmp_path / "run", folder, 3, "parallel.dp_shard=2", "parallel.tp=2", *experts)
    results = launch(TESTS / "helpers" / "init_from_worker.py", 4, overrides, timeout=240)
    assert all(r.returncode == 0 for r in results), "\n".join(r.stdout[-3000:] for r in results)
    line = next(li for li in results[0].stdout.splitlines() if li.startswith("HISTORY "))
    losses = [record["train/loss"] for record in json.loads(line.removeprefix("HISTORY "))]
    assert len(losses) == 3 and all(map(torch.isfinite, torch.tensor(losses)))
    assert abs(losses[0] - _transformers_loss(hf_model, overrides, dp_size=2)) < LOSS_TOLERANCE  # seen: 5e-7
    _check_export(hf_model, tmp_path / "run", tmp_path / "exported")


def test_first_step_matches_transformers_and_a_restart_never_reads_the_folder_again(shards, tmp_path):
    hf_model, folder = hf_folder("mistral", tmp_path / "hf")
    run_dir = tmp_path / "run"
    overrides = _overrides(shards, run_dir, folder, 2, "checkpoint.interval=2", "model.dropout=0.0")
    _, result = run_trainer(load_config(None, overrides))
    assert result is not None and result.steps == 2
    assert abs(result.history[0]["train/loss"] - _transformers_loss(hf_model, overrides, dp_size=1)) < LOSS_TOLERANCE
    _check_export(hf_model, run_dir, tmp_path / "exported")

    # The restart takes its model config and weights from step 2: without the folder's weights and config.json it
    # still runs (only the tokenizer is read there), and it continues from step 2, not from the imported weights.
    for name in ("model.safetensors", "config.json"):
        (folder / name).unlink()
    shutil.rmtree(run_dir / "final")
    trainer, result = run_trainer(load_config(None, _overrides(shards, run_dir, folder, 4, "checkpoint.interval=2")))
    assert result is not None and result.steps == 4 and len(result.history) == 2
    assert trainer.checkpoints.loaded_from == run_dir / "checkpoints" / "step-00000002"


def test_an_olmoe_folder_continues_from_transformers_loss(shards, tmp_path):
    hf_model, folder = hf_folder("olmoe", tmp_path / "hf")
    overrides = _overrides(shards, tmp_path / "run", folder, 1, "model.dropout=0.0")
    _, result = run_trainer(load_config(None, overrides))
    assert result is not None and result.steps == 1
    assert abs(result.history[0]["train/loss"] - _transformers_loss(hf_model, overrides, dp_size=1)) < LOSS_TOLERANCE
    _check_export(hf_model, tmp_path / "run", tmp_path / "exported")


def test_a_model_key_that_changes_the_function_is_refused_by_name(shards, tmp_path, capsys):
    _, folder = hf_folder("llama", tmp_path / "hf")
    base = _overrides(shards, tmp_path / "run", folder, 1)
    cfg = resolve_init_from(load_config(None, [*base, "model.attention.dropout=0.1"]))  # training-only: kept
    assert cfg.model.attention.dropout == 0.1 and cfg.model.rope.scaling == "llama3" and cfg.model.d_model == 32
    assert cfg.data.tokenizer == str(folder)
    with pytest.raises(SystemExit) as info:  # the user's own file: its [model] keys are checked too
        main(["train", str(CONFIGS / "tiny-gpt.toml"), "--init-from", str(folder), "--set", *base[:-1],
              "model.n_layers=3"])
    line = str(info.value.code)
    assert line.startswith("error: checkpoint.init_from: ") and "\n" not in line, line
    for named in ("model.max_seq_len=128 (it has 64)", "model.n_layers=3 (it has 2)", "remove those [model] keys"):
        assert named in line, line


def test_init_from_needs_no_config_and_says_what_it_took_from_the_folder(shards, tmp_path, monkeypatch, capsys):
    """`meshformer train --init-from PATH`: the bundled continued-pretraining run, in runs/<folder name>, with the
    folder's model and tokenizer; one log line lists what came from the folder."""
    _, folder = hf_folder("llama", tmp_path / "my-llama")
    monkeypatch.chdir(tmp_path)
    main(["train", "--init-from", str(folder), "--set", f'data.shards="{shards}"', "data.seq_len=32",
          "data.num_workers=0", "data.shuffle_shards=2", "train.steps=2", "train.eval_interval=0",
          "train.sample_interval=0", "train.device=cpu", "logging.tensorboard=false"])
    run_dir = tmp_path / "runs" / folder.name
    assert (run_dir / "final").is_dir()
    taken = [line for line in capsys.readouterr().err.splitlines() if "] from hf:" in line]
    assert len(taken) == 1, taken
    assert "model (llama: 2 layers, d_model 32" in taken[0] and "tokenizer" in taken[0] and "weights" in taken[0]
    with pytest.raises(SystemExit) as info:  # no config and no folder: one line saying both ways in
        main(["train"])
    assert "--init-from" in str(info.value.code) and "tiny-gpt" in str(info.value.code)


def test_a_bundled_config_with_init_from_takes_the_folders_model(shards, tmp_path):
    """A bundled config's [model] describes a from-scratch model: the folder's replaces it; --set keys still count."""
    _, folder = hf_folder("llama", tmp_path / "hf")
    base = _overrides(shards, tmp_path / "run", folder, 1)
    cfg = resolve_init_from(load_config("tiny-gpt", base))
    assert cfg.model.d_model == 32 and cfg.model.n_layers == 2 and cfg.data.tokenizer == str(folder)
    assert cfg.optim.lr == load_config("tiny-gpt").optim.lr  # the rest of the bundled run is kept


def test_every_conflicting_key_is_named_with_the_folders_value_in_one_line(shards, tmp_path):
    _, folder = hf_folder("llama", tmp_path / "hf")
    base = _overrides(shards, tmp_path / "run", folder, 1)
    with pytest.raises(SystemExit) as info:
        main(["train", "tiny-gpt", "--init-from", str(folder), "--set", *base[:-1], "model.n_layers=3",
              "model.d_model=64", "data.seq_len=128"])
    line = str(info.value.code)
    assert line.startswith("error: checkpoint.init_from: ") and "\n" not in line, line
    for named in ("model.n_layers=3 (it has 2)", "model.d_model=64 (it has 32)", "data.seq_len=128 (its context is "
                  "64)", "set data.seq_len <= 64"):
        assert named in line, line


def test_an_expert_width_set_as_moe_d_ff_is_the_folders_own(shards, tmp_path):
    # Mixtral's experts are intermediate_size wide (imported as d_ff, moe_d_ff=0); a config that names the same width
    # as moe_d_ff (tiny-moe does) describes the same function and continues from the folder
    _, folder = hf_folder("mixtral", tmp_path / "hf")
    base = _overrides(shards, tmp_path / "run", folder, 1, "model.moe.n_experts=4", "model.moe.experts_per_token=2")
    cfg = resolve_init_from(load_config(None, [*base, "model.moe.d_ff=64"]))
    assert cfg.model.expert_d_ff == 64 and cfg.model.moe.n_experts == 4
    with pytest.raises(ConfigError, match=r"model.moe.d_ff=32 \(it has 0\)"):  # another width: refused by name
        resolve_init_from(load_config(None, [*base, "model.moe.d_ff=32"]))


def test_a_folder_whose_blocks_are_all_dense_continues_as_it_is(shards, tmp_path):
    # config validation refuses experts that no block uses in the user's own config, not in the folder's model
    _, folder = hf_folder("qwen3_moe_dense", tmp_path / "hf")
    cfg = resolve_init_from(load_config(None, _overrides(shards, tmp_path / "run", folder, 1)))
    assert cfg.model.moe.n_experts == 4 and cfg.model.mlp_types == ["dense", "dense"] and cfg.model.n_layers == 2


def test_renamed_tensors_are_read_by_slices_and_the_rest_whole(tmp_path):
    """What keeps an init_from load from holding the whole model on a rank: a tensor that is only renamed comes
    as a lazy safetensors slice (this rank's rows alone are read), and every tensor equals the imported one."""
    from meshformer.checkpointing.hf import from_hf_model
    from meshformer.checkpointing.init_from import HFInitWeights

    hf_model, folder = hf_folder("qwen3", tmp_path / "hf")
    source = HFInitWeights(folder)
    assert source.arch == "qwen3"
    expected = from_hf_model(hf_model).state_dict()
    assert all(name in source for name in expected)
    sliced = [name for name in expected if not isinstance(source.get_slice(name), torch.Tensor)]
    assert "tok_embeddings.weight" in sliced and len(sliced) == len(expected)  # Qwen3: renames only
    for name, tensor in expected.items():
        torch.testing.assert_close(source.get_slice(name)[1:3], tensor[1:3], rtol=0, atol=0)


def _hub_cache_snapshot(hf_model, cache: Path) -> Path:
    """`hf_model` saved in shards and laid out as the Hugging Face hub cache keeps a download: the snapshot's files
    are links to `../../blobs/<hash>`."""
    import hashlib

    from meshformer.data.tokenizer import BUNDLED_DIR

    staged, repo = cache / "staged", cache / "models--org--tiny"
    hf_model.save_pretrained(str(staged), max_shard_size="500KB")
    shutil.copy(BUNDLED_DIR / "kjv-bpe-4k.json", staged / "tokenizer.json")
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(staged.iterdir()):
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        file.rename(repo / "blobs" / blob)
        (snapshot / file.name).symlink_to(f"../../blobs/{blob}")
    assert (snapshot / "model.safetensors.index.json").is_symlink()
    return snapshot


def test_a_hub_cache_snapshot_imports_and_continues_but_links_out_of_a_folder_are_refused(shards, tmp_path, capsys):
    from meshformer.checkpointing.hf import from_hf_model

    hf_model, _ = hf_folder("llama", tmp_path / "hf")
    snapshot = _hub_cache_snapshot(hf_model, tmp_path / "hub")
    main(["convert", "import-hf", str(snapshot), str(tmp_path / "imported")])
    expected = from_hf_model(hf_model).state_dict()
    imported = load_weights(tmp_path / "imported").state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(imported[name], tensor, rtol=0, atol=0)
    _, result = run_trainer(load_config(None, _overrides(shards, tmp_path / "run", snapshot, 1)))
    assert result is not None and result.steps == 1 and torch.isfinite(torch.tensor(result.history[0]["train/loss"]))

    # the same files linked from a plain folder leave it: refused in one line, for init_from as for import-hf
    plain = tmp_path / "plain"
    plain.mkdir()
    for link in snapshot.iterdir():
        (plain / link.name).symlink_to(link.resolve())
    with pytest.raises(SystemExit) as info:
        main(["train", str(TESTS.parent / "configs" / "tiny-gpt.toml"), "--set",
              *_overrides(shards, tmp_path / "run2", plain, 1), "model.max_seq_len=64"])
    line = str(info.value.code)
    assert line.startswith("error: Hugging Face folder ") and "\n" not in line and "links to" in line, line
    assert "cp -L" in line, line
    main(["convert", "import-hf", str(plain), str(tmp_path / "followed"), "--follow-links"])  # read where they point
    followed = load_weights(tmp_path / "followed").state_dict()
    assert all(torch.equal(followed[name], tensor) for name, tensor in imported.items())


def test_a_nan_tensor_in_the_folder_is_named_before_step_1(shards, tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = hf_folder("llama", tmp_path / "hf")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "run.toml").write_text("")  # every key from the overrides, the model from the folder
    with pytest.raises(SystemExit) as info:
        main(["train", str(tmp_path / "run.toml"), "--set", *_overrides(shards, tmp_path / "run", folder, 2)])
    line = str(info.value.code)
    assert line.startswith("error: checkpoint.init_from: ") and "\n" not in line, line
    assert "'model.layers.1.mlp.down_proj.weight'" in line and "NaN or inf" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


def test_a_model_key_set_to_its_default_value_is_still_named(shards, tmp_path):
    # model.n_layers defaults to 4: written out, it asks for 4 layers, which the 2-layer folder does not have
    from meshformer.model.config import ModelConfig

    _, folder = hf_folder("llama", tmp_path / "hf")
    base = _overrides(shards, tmp_path / "run", folder, 1)
    assert ModelConfig().n_layers == 4 and ModelConfig().norm.kind == "layernorm"
    with pytest.raises(ConfigError) as info:
        resolve_init_from(load_config(None, [*base, "model.n_layers=4", "model.norm.kind=layernorm"]))
    assert "model.n_layers=4 (it has 2)" in str(info.value) and "model.norm.kind='layernorm' (it has 'rmsnorm')" in \
        str(info.value), info.value
    assert resolve_init_from(load_config(None, [*base, "model.n_layers=2"])).model.n_layers == 2  # the folder's own
