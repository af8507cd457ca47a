"""An lm-evaluation-harness `LM` over a meshformer model: tasks, prompts, few-shot sampling, filters and metrics are
lm-eval's; this file turns its three request types into forward passes of the model.

Requests are tokenized as lm-eval's `hf` model tokenizes them (TemplateLM's context/continuation split, rolling
windows of the model's length, contexts cut from the left), so on the same weights the log-likelihoods and greedy
generations are the `hf` model's. Requests are sorted longest first and batched, and results come back in the
request order: a request's score does not depend on the others in its batch (right padding for scoring, left padding
with the padding masked for generation).

Data-parallel ranks (torch.distributed initialised, each rank a whole model) share the requests through lm-eval's
own protocol: `rank` and `world_size` tell its evaluator to hand each rank a slice and gather the results.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from meshformer.data import Tokenizer
from meshformer.errors import UsageError
from meshformer.model import Transformer
from meshformer.model.generate import greedy_decode, pad_rows

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's own default for generate_until
Pair = tuple[list[int], list[int]]  # (context tokens, continuation tokens)
# a layout's own scoring of (context, continuation) pairs: (summed log-likelihood, whether greedy) per pair
Scorer = Callable[[list[Pair]], list[tuple[float, bool]]]


def _sorted_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Request indices, longest first (ties by index: deterministic), in batches of `batch_size`."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[at:at + batch_size] for at in range(0, len(order), batch_size)]


@register_model("meshformer")
class MeshformerLM(TemplateLM):
    """lm-eval's `LM` over a meshformer `Transformer` and its tokenizer.

    From lm-eval: `--model meshformer --model_args path=FOLDER[,batch_size=N][,max_length=N]` (a run folder, its
    `final/`, or a Hugging Face folder); from Python: `MeshformerLM(model=..., tokenizer=...)`.
    `poll` runs before each batch (a training run's stop check, which raises to end the evaluation).
    `scorer`: the training layout's evaluation forward (train/downstream.py `LayoutScorer`), which scores the
    log-likelihood requests instead of `model` and shares them between data-parallel ranks itself: every rank then
    runs lm-eval's evaluator on all requests and gets the same results (`model` may be None: no generation)."""

    backend = "causal"
    model: Transformer | None  # None: a layout's scorer without the whole model on this rank (no generation)

    def __init__(self, path: str | None = None, *, model: Transformer | None = None,
                 tokenizer: Tokenizer | None = None, batch_size: int | str = 16, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, poll: Callable[[], None] | None = None,
                 scorer: Scorer | None = None, **unused: Any) -> None:
        super().__init__()
        if scorer is not None and path is None:
            self._init_scored(model, tokenizer, scorer, batch_size, max_length, max_gen_toks, poll)
            return
        if (path is None) == (model is None):
            raise UsageError("MeshformerLM needs a folder or a model, not both",
                             "pass path=FOLDER, or model= and tokenizer=")
        if path is not None:
            from meshformer.eval.model_folder import load_model_folder

            model, tokenizer = load_model_folder(Path(path))
        if tokenizer is None:
            raise UsageError("MeshformerLM(model=...) needs the model's tokenizer", "pass tokenizer=")
        assert model is not None
        if not model.spec.has_decoder or model.spec.seq2seq:
            raise UsageError("lm-eval scores decoder-only models; this one is not",
                             "evaluate a decoder-only (causal) model")
        self.model, self.mf_tokenizer = model.eval(), tokenizer
        self.scorer: Scorer | None = None
        self._batch_size = int(batch_size) if str(batch_size) != "auto" else 16
        self._max_length = int(max_length or model.cfg.max_seq_len)
        self._max_gen_toks = int(max_gen_toks)
        self.poll = poll or (lambda: None)
        self._device = next(model.parameters()).device
        if dist.is_available() and dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    def _init_scored(self, model: Transformer | None, tokenizer: Tokenizer | None, scorer: Scorer,
                     batch_size: int | str, max_length: int | None, max_gen_toks: int,
                     poll: Callable[[], None] | None) -> None:
        if tokenizer is None or max_length is None:
            raise UsageError("MeshformerLM(scorer=...) needs the tokenizer and the model's length",
                             "pass tokenizer= and max_length=")
        self.model = model.eval() if model is not None else None
        self.mf_tokenizer, self.scorer = tokenizer, scorer
        self._batch_size = int(batch_size) if str(batch_size) != "auto" else 16
        self._max_length, self._max_gen_toks = int(max_length), int(max_gen_toks)
        self.poll = poll or (lambda: None)
        self._device = next(model.parameters()).device if model is not None else torch.device("cpu")

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
                            ) -> MeshformerLM:
        extra = {k: v for k, v in (additional_config or {}).items() if k == "batch_size" and v is not None}
        return cls(**{**arg_dict, **extra})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None
                               ) -> MeshformerLM:
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    # --------------------------------------------------------------------------------------------- lm-eval's hooks

    @property
    def eot_token_id(self) -> int:
        return self.mf_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.mf_tokenizer.bos_id  # the tokenizer's BOS, else its EOS (as `hf` picks it)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.mf_tokenizer.name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        # `hf` frames text with the tokenizer's post-processor unless asked not to (an empty context's continuation)
        if add_special_tokens is False:
            return self.mf_tokenizer.encode(string)
        return self.mf_tokenizer.encode_prompt(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.mf_tokenizer.decode(tokens, skip_special_tokens=True)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        gathered = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(gathered, tensor)
        return torch.cat([g.reshape(-1) if g.ndim == 0 else g for g in gathered])

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        dist.barrier()

    # --------------------------------------------------------------------------------------------- scoring

    @torch.no_grad()
    def score_pairs(self, pairs: list[Pair]) -> list[tuple[float, bool]]:
        """(summed log-likelihood of the continuation, whether it is the greedy continuation) per (context,
        continuation) pair: the last max_length + 1 tokens (left truncation), shifted by one."""
        if self.scorer is not None:
            return self.scorer(pairs)
        rows = [(context + continuation)[-(self.max_length + 1):][:-1] for context, continuation in pairs]
        # requests with the same input (one-token choices after one context) share one row of the batch
        unique: dict[tuple[int, ...], int] = {}
        owners: list[list[int]] = []
        for i, tokens in enumerate(rows):
            at = unique.setdefault(tuple(tokens), len(owners))
            if at == len(owners):
                owners.append([])
            owners[at].append(i)
        inputs = list(unique)
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        for batch in _sorted_batches([len(r) for r in inputs], self.batch_size):
            self.poll()
            width = len(inputs[batch[0]])
            ids = torch.full((len(batch), width), self.mf_tokenizer.pad_id, dtype=torch.long)
            for row, u in enumerate(batch):  # right padding: a causal model's scores ignore what follows
                ids[row, :len(inputs[u])] = torch.tensor(inputs[u])
            assert self.model is not None
            logprobs = F.log_softmax(self.model(ids.to(self.device)).float(), dim=-1)
            for row, u in enumerate(batch):
                for i in owners[u]:
                    continuation = pairs[i][1]
                    n, end = len(continuation), len(inputs[u])
                    span = logprobs[row, end - n:end]
                    target = torch.tensor(continuation, device=span.device)
                    greedy = bool((span.argmax(-1) == target).all())
                    results[i] = (float(span.gather(1, target[:, None]).sum()), greedy)
        return results

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        results = self.score_pairs([(context, continuation) for _, context, continuation in requests])
        for (strings, _, _), result in zip(requests, results):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of the model's length (lm-eval's rolling windows)."""
        windows: list[Pair] = []
        owner: list[int] = []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (loglik, _) in zip(owner, self.score_pairs(windows)):
            totals[i] += loglik
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --------------------------------------------------------------------------------------------- generation

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, batched per set of generation options, each cut at its first stop string."""
        if self.model is None:
            raise UsageError("generate_until needs the whole model on each rank; this layout splits it",
                             "score generation tasks with `meshformer eval` on the run's final/ folder")
        eos = self.mf_tokenizer.decode([self.eot_token_id])
        results: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        for members in groups.values():
            options = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self._max_gen_toks)
            until = handle_stop_sequences(options.pop("until", None), eos=eos)
            max_gen = int(options.pop("max_gen_toks"))
            if options.pop("do_sample", False) or float(options.pop("temperature", 0.0) or 0.0) > 0.0:
                raise UsageError("meshformer's lm-eval model decodes greedily; a task asks for sampling",
                                 "set do_sample: false (temperature 0) in the task's generation_kwargs")
            if max_gen >= self.max_length:
                raise UsageError(f"a task asks for {max_gen} new tokens but the model holds {self.max_length}",
                                 "lower the task's max_gen_toks")
            prompts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - max_gen):] for i in members}
            lengths = [len(prompts[i]) for i in members]
            for batch in _sorted_batches(lengths, self.batch_size):
                texts = self._generate([prompts[members[j]] for j in batch], max_gen, until)
                for j, text in zip(batch, texts):
                    results[members[j]] = text
                    self.cache_hook.add_partial("generate_until", requests[members[j]].args, text)
        return results

    def _generate(self, prompts: list[list[int]], max_gen: int, until: list[str]) -> list[str]:
        self.poll()
        ids, padding = pad_rows(prompts, self.mf_tokenizer.pad_id, left=True, device=self.device)
        start = ids.shape[1]

        def stopped(tokens: torch.Tensor) -> torch.Tensor:
            texts = [self.tok_decode(row) for row in tokens[:, start:].tolist()]
            return torch.tensor([any(stop in text for stop in until) for text in texts], device=tokens.device)

        assert self.model is not None
        out = greedy_decode(self.model, ids, max_gen, prompt_padding=padding, eos_id=self.eot_token_id,
                            stopped=stopped, between_tokens=self.poll)
        texts = []
        for row in out[:, start:].tolist():
            if self.eot_token_id in row:
                row = row[:row.index(self.eot_token_id)]
            texts.append(postprocess_generated_text(self.tok_decode(row), until, None))
        return texts
