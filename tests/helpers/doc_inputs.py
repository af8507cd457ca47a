"""The inputs the documentation's commands name (`my_corpus/`, `dclm/*.jsonl.zst`, `hf/llama3/`, ...), written small
into a folder so the commands run there as shown."""

from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path

import numpy as np

from helpers.data import kjv_docs
from meshformer.data import load_tokenizer


def _jsonl(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


def _parquet(path: Path, docs: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=8)


def _megatron(prefix: Path, docs: list[list[int]]) -> None:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(str(prefix) + ".idx")


def write_doc_inputs(folder: Path) -> None:
    import datasets
    import zstandard

    docs = kjv_docs(60)
    (folder / "my_corpus").mkdir(parents=True)
    for i in range(3):
        (folder / "my_corpus" / f"part-{i}.txt").write_text("\n\n".join(docs[i::3]))
    (folder / "dclm").mkdir()
    for i in range(2):
        (folder / "dclm" / f"shard-{i}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
            _jsonl(docs[i::2])))
    _parquet(folder / "fineweb" / "000.parquet", docs[:30])
    _parquet(folder / "fineweb" / "001.parquet", docs[30:])
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(folder / "saved_dataset"))
    mixed = folder / "mixed_folder"
    mixed.mkdir()
    (mixed / "a.txt").write_text("\n\n".join(docs[:20]))
    (mixed / "b.jsonl.gz").write_bytes(gzip.compress(_jsonl(docs[20:40])))
    _parquet(mixed / "c.parquet", docs[40:])

    # Token ids of GPT-2's tokenizer, the one the pre-tokenized examples name.
    gpt2 = load_tokenizer("gpt2")
    ids = [gpt2.encode(d) for d in docs]
    _megatron(folder / "megatron" / "my_text_document", [[*d, gpt2.eos_id] for d in ids])
    flat = np.array([t for d in ids for t in [*d, gpt2.eos_id]], dtype=np.uint16)
    (folder / "nanogpt").mkdir()
    flat.tofile(folder / "nanogpt" / "train.bin")
    (folder / "olmo").mkdir()
    np.save(folder / "olmo" / "part-0.npy", flat.astype(np.uint32))

    # A Hugging Face tokenizer folder with Llama 3's special-token names.
    from tokenizers import AddedToken

    hf = load_tokenizer("bundled:kjv-bpe-4k").hf
    hf.add_special_tokens([AddedToken("<|begin_of_text|>", special=True),
                           AddedToken("<|end_of_text|>", special=True)])
    llama3 = folder / "hf" / "llama3"
    llama3.mkdir(parents=True)
    hf.save(str(llama3 / "tokenizer.json"))
    (llama3 / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                              "eos_token": "<|end_of_text|>"}))

    # A tiktoken BPE file: the 256 bytes, no merges.
    (folder / "tok").mkdir()
    (folder / "tok" / "my_bpe.tiktoken").write_text(
        "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))

    notes = folder / "notes"
    notes.mkdir()
    (notes / "NEWS").write_text("\n\n".join(docs[:10]))
    (notes / "todo.log").write_text("\n\n".join(docs[10:20]))
