"""lm-eval's own command line with meshformer's model registered:
`python -m meshformer.eval --model meshformer --model_args path=FOLDER --tasks hellaswag` takes every option of
`lm_eval` (lm-eval finds models only among those imported before its CLI runs)."""

from lm_eval.__main__ import cli_evaluate

import meshformer.eval.lm  # noqa: F401  (registers "meshformer")

if __name__ == "__main__":
    cli_evaluate()
