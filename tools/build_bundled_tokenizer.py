"""Rebuild meshformer/data/tokenizers/kjv-bpe-4k.json: byte-level BPE, vocab 4096, on the bundled corpus.

    python tools/build_bundled_tokenizer.py

Deterministic: the same corpus gives the same file (checked by `tests/unit/data/test_data_tokenizer.py`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from meshformer.data.sources import iter_documents, resolve_inputs
from meshformer.data.tokenizer import BUNDLED_DIR, train_bpe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="bundled:kjv")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=BUNDLED_DIR / "kjv-bpe-4k.json")
    args = parser.parse_args()
    docs = list(iter_documents(resolve_inputs(args.corpus)))
    tok = train_bpe(docs, vocab_size=args.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(args.out)
    print(f"wrote {args.out}: vocab {tok.vocab_size}, sha256 {tok.sha256}")


if __name__ == "__main__":
    main()
