"""Greedy decoding of an imported Hugging Face model equals transformers' `generate(do_sample=False)` on a batch of
prompts of different lengths (left padding, KV cache), and `meshformer generate` frames prompts as the model's
tokenizer does (BOS where it adds one) and stops at its EOS."""

from __future__ import annotations

import pytest
from helpers.hf_models import assert_batched_greedy_equals_generate, hf_folder

from meshformer.model.generate import pad_rows

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 10


@pytest.mark.parametrize("arch", ["llama", "qwen3", "olmo2", "olmo3", "gemma3", "gpt_oss", "deepseek_v3",
                                  "deepseek_v2", "glm4_moe", "qwen3_next", "qwen3_5_text",
                                  "qwen3_5_moe_text", "kimi_linear", "olmo_hybrid"])
def test_batched_greedy_equals_transformers_generate(arch):
    assert_batched_greedy_equals_generate(arch, NEW_TOKENS)


def test_generate_cli_adds_the_tokenizers_bos_batches_prompts_and_stops_at_its_eos(tmp_path, capsys):
    from tokenizers import Tokenizer, processors

    from meshformer.cli import main

    theirs, folder = hf_folder("llama", tmp_path / "hf")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = tokenizer.token_to_id("<bos>")  # prepended by the post-processor, as Llama 3's <|begin_of_text|> is
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tokenizer.save(str(folder / "tokenizer.json"))
    prompts = ["In the beginning God created", "And the earth was", "Let there be light: and there was"]
    rows = [tokenizer.encode(p).ids for p in prompts]
    assert all(row[0] == bos for row in rows)
    ids, padding = pad_rows(rows, pad_id=0)
    free = theirs.generate(input_ids=ids, attention_mask=padding.long(), max_new_tokens=NEW_TOKENS,
                           min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[:, ids.shape[1]:].tolist()
    eos = free[1][3]  # the tokenizer's EOS: the second prompt's 4th new token
    (folder / "tokenizer_config.json").write_text(
        f'{{"bos_token": "<bos>", "eos_token": "{tokenizer.id_to_token(eos)}", "pad_token": "<pad>"}}')
    expected = [tokenizer.decode(row + (new[:new.index(eos)] if eos in new else new), skip_special_tokens=True)
                for row, new in zip(rows, free)]

    main(["convert", "import-hf", str(folder), str(tmp_path / "ours")])
    (tmp_path / "more.txt").write_text(f"{prompts[2]}\n\n")
    capsys.readouterr()
    main(["generate", str(tmp_path / "ours"), "--tokenizer", str(folder), "--prompt", prompts[0], "--prompt",
          prompts[1], "--prompts-file", str(tmp_path / "more.txt"), "--max-new-tokens", str(NEW_TOKENS)])
    assert capsys.readouterr().out == "".join(line + "\n" for line in expected)
    assert expected[1] != tokenizer.decode(rows[1] + free[1], skip_special_tokens=True)  # it did stop early
