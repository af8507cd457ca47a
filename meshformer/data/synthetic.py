"""A generated corpus for tests and benchmarks: JSONL files of word-salad documents, no downloads.

Each document starts with its number (`doc 000123:`), so a prepared stream can be traced back to the input
order (shuffle quality), and sizes are exact to the byte budget asked for.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_WORDS = ("the of and to in that he was for it with as his on be at by this had not are but from or have an "
          "they which one you were her all she there would their we him been has when who will more no if out so "
          "said what up its about into than them can only other new some could time these two may then do first "
          "any my now such like our over man me even most made after also did many before must through back years "
          "where much your way well down should because each just those people how too little state good very make "
          "world still own see men work long get here between both life being under never day same another know "
          "while last might us great old year off come since against go came right used take three").split()


def write_corpus(folder: Path, megabytes: float, files: int = 8, seed: int = 0, mean_words: int = 300) -> Path:
    """`files` JSONL files holding about `megabytes` of text in all; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    budget = int(megabytes * (1 << 20)) // files
    doc = 0
    for f in range(files):
        size = 0
        with open(folder / f"part-{f:04d}.jsonl", "w") as fh:
            while size < budget:
                words = rng.choice(len(_WORDS), size=max(5, int(rng.exponential(mean_words))))
                text = f"doc {doc:07d}: " + " ".join(_WORDS[w] for w in words.tolist()) + "."
                line = json.dumps({"text": text}) + "\n"
                fh.write(line)
                size += len(line)
                doc += 1
    return folder
