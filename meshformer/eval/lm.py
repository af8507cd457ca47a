"""An lm-evaluation-harness `LM` over a meshformer model: tasks, prompts, few-shot sampling, filters and metrics are
lm-eval's; this file turns its three request types into forward passes of the model.

Requests are tokenized as lm-eval's `hf` model tokenizes them (TemplateLM's context/continuation split, rolling
windows of the model's length, contexts cut from the left), so on the same weights the log-likelihoods and greedy
generations are the `hf` model's. Requests are sorted longest first and batched, and results come back in the
request order: a request's score does not depend on the others in its batch (right padding for scoring, left padding
with the padding masked for generation).

Data-parallel ranks (torch.distributed initialised, each rank a whole model) share the requests through lm-eval's
own protocol: `rank` and `world_size` tell its evaluator to hand each rank a slice and gather the results. Under a
layout that splits the model (eval/layout_forward.py), every rank runs the evaluator on all requests and the layout's
evaluation forward scores them and gives each decoding step's logits.

Sampled generation (`do_sample` with a temperature, `top_k`, `top_p`) draws each request's tokens from its own
generator, seeded from `seed` and the request's identity (task, document, index, repeat): the same tokens whatever
the batch, the order, the data-parallel rank or the layout that decodes it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

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
from meshformer.model.attention import Attention
from meshformer.model.generate import greedy_decode, pad_rows

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's own default for generate_until
DEFAULT_SEED = 1234  # lm-eval's default seed (its --seed), for sampled generation
Pair = tuple[list[int], list[int]]  # (context tokens, continuation tokens)
# a layout's own scoring of (context, continuation) pairs: (summed log-likelihood, whether greedy) per pair
Scorer = Callable[[list[Pair]], list[tuple[float, bool]]]


class NextLogits(Protocol):
    """A layout's decoding step (eval/layout_forward.py `LayoutNextLogits`): the fp32 logits (n, vocabulary) of the
    token after each of n sequences, the same on every rank; `rows_per_call`: how many sequences a call takes."""

    rows_per_call: int

    def __call__(self, sequences: list[list[int]]) -> torch.Tensor: ...


@contextmanager
def sdpa_attention(model: torch.nn.Module) -> Iterator[None]:
    """The model's `auto` attention through SDPA for the adapter's forwards. `auto` picks the blockwise CPU kernel
    (model/blockwise_attention.py) for its backward, which keeps the probabilities; a forward without gradients
    runs about twice as fast in SDPA's fused kernel on the CPU (and `auto` is SDPA elsewhere)."""
    switched = [m for m in model.modules() if isinstance(m, Attention) and m.backend == "auto"]
    for module in switched:
        module.backend = "sdpa"
    try:
        yield
    finally:
        for module in switched:
            module.backend = "auto"


def _sorted_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Request indices, longest first (ties by index: deterministic), in batches of `batch_size`."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[at:at + batch_size] for at in range(0, len(order), batch_size)]


@register_model("meshformer")
class MeshformerLM(TemplateLM):
    """lm-eval's `LM` over a meshformer `Transformer` and its tokenizer.

    From lm-eval: `--model meshformer --model_args path=FOLDER[,batch_size=N][,max_length=N][,seed=N]` (a run
    folder, its `final/`, a checkpoint or a Hugging Face folder: eval/model_folder.py); from Python:
    `MeshformerLM(model=..., tokenizer=...)`.
    `poll` runs before each batch (a training run's stop check, which raises to end the evaluation).
    `scorer`: the layout's evaluation forward (eval/layout_forward.py `LayoutScorer`), which scores the
    log-likelihood requests instead of `model` and shares them between data-parallel ranks itself: every rank then
    runs lm-eval's evaluator on all requests and gets the same results. `next_logits`: the layout's decoding step,
    for generation without a whole model (`model` None). `seed`: sampled generation's seed."""

    backend = "causal"
    model: Transformer | None  # None: a layout without the whole model on this rank (generation: next_logits)

    def __init__(self, path: str | None = None, *, model: Transformer | None = None,
                 tokenizer: Tokenizer | None = None, batch_size: int | str = 16, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, poll: Callable[[], None] | None = None,
                 scorer: Scorer | None = None, next_logits: NextLogits | None = None, seed: int | str = DEFAULT_SEED,
                 **unused: Any) -> None:
        super().__init__()
        self.seed, self.next_logits = int(seed), next_logits
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

    def score_pairs(self, pairs: list[Pair]) -> list[tuple[float, bool]]:
        """(summed log-likelihood of the continuation, whether it is the greedy continuation) per (context,
        continuation) pair: the last max_length + 1 tokens (left truncation), shifted by one."""
        if self.scorer is not None:
            return self.scorer(pairs)
        totals, greedy = self._score(pairs, greedy=True)
        assert greedy is not None
        return list(zip(totals, greedy))

    @torch.no_grad()
    def _score(self, pairs: list[Pair], *, greedy: bool) -> tuple[list[float], list[bool] | None]:
        """Summed log-likelihoods of the pairs' continuations, and whether each is the greedy one (`greedy`;
        rolling windows do not need it) through the whole model.

        The output head and the log-softmax run on the scored positions only (a row's continuation, not its context
        or its padding): on a small model they are most of a batch's time."""
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
        totals = [0.0] * len(pairs)
        hits = [True] * len(pairs)
        assert self.model is not None
        for batch in _sorted_batches([len(r) for r in inputs], self.batch_size):
            self.poll()
            width = len(inputs[batch[0]])
            ids = torch.full((len(batch), width), self.mf_tokenizer.pad_id, dtype=torch.long)
            # scored positions: each row's last tokens, as many as its longest continuation (its requests share
            # them); `place`, `targets`, `request`: each request's tokens as (position, token, request)
            row_of: list[int] = []
            col_of: list[int] = []
            place: list[int] = []
            targets: list[int] = []
            request: list[int] = []
            for row, u in enumerate(batch):  # right padding: a causal model's scores ignore what follows
                ids[row, :len(inputs[u])] = torch.tensor(inputs[u])
                end, scored = len(inputs[u]), max(len(pairs[i][1]) for i in owners[u])
                first = len(row_of)
                row_of += [row] * scored
                col_of.extend(range(end - scored, end))
                for i in owners[u]:
                    continuation = pairs[i][1]
                    place.extend(range(first + scored - len(continuation), first + scored))
                    targets += continuation
                    request += [i] * len(continuation)
            with sdpa_attention(self.model):
                logits = self.model(ids.to(self.device), labels=ids, head_loss=self._head_at(
                    torch.tensor(row_of), torch.tensor(col_of)))
            logprobs = F.log_softmax(logits.float(), dim=-1)
            where, target = torch.tensor(place, device=logprobs.device), torch.tensor(targets, device=logprobs.device)
            owner = torch.tensor(request)
            sums = torch.zeros(len(pairs), dtype=torch.float32).index_add_(0, owner, logprobs[where, target].cpu())
            values = sums.tolist()
            for i in dict.fromkeys(request):
                totals[i] = values[i]
            if greedy:
                missed = logprobs.argmax(-1)[where] != target
                for i in owner[missed.cpu()].tolist():
                    hits[i] = False
        return totals, hits if greedy else None

    def _head_at(self, rows: torch.Tensor, cols: torch.Tensor) -> Callable[..., torch.Tensor]:
        """The model's output head applied at positions (rows, cols) of its final hidden states only: (positions,
        vocabulary) logits. Given to the model as its head loss, which receives the final hidden states (after
        any head transform and output scaling) and the output weight."""
        softcap = self.model.cfg.logit_softcap if self.model is not None else None

        def head(h: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
            logits = F.linear(h[rows.to(h.device), cols.to(h.device)], weight, bias)
            return logits if softcap is None else softcap * torch.tanh(logits / softcap)

        return head

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
        scores = [loglik for loglik, _ in self.scorer(windows)] if self.scorer is not None \
            else self._score(windows, greedy=False)[0]
        for i, loglik in zip(owner, scores):
            totals[i] += loglik
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --------------------------------------------------------------------------------------------- generation

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy or sampled continuations, batched per set of generation options, each cut at its first stop
        string (and at the end-of-text token)."""
        if self.model is None and self.next_logits is None:
            raise UsageError("generate_until needs the whole model on each rank; this layout splits it",
                             "score generation tasks with `meshformer eval` on the run's final/ folder")
        eos = self.mf_tokenizer.decode([self.eot_token_id])
        results: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        seeds = request_seeds(requests, self.seed)
        for members in groups.values():
            options = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self._max_gen_toks)
            until = handle_stop_sequences(options.pop("until", None), eos=eos)
            max_gen = int(options.pop("max_gen_toks"))
            sampling = Sampling.from_options(options)
            if max_gen >= self.max_length:
                raise UsageError(f"a task asks for {max_gen} new tokens but the model holds {self.max_length}",
                                 "lower the task's max_gen_toks")
            prompts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - max_gen):] for i in members}
            lengths = [len(prompts[i]) for i in members]
            per_call = self.next_logits.rows_per_call if self.model is None and self.next_logits else self.batch_size
            for batch in _sorted_batches(lengths, per_call):
                rows = [members[j] for j in batch]
                generators = None if sampling is None else [_generator(seeds[i]) for i in rows]
                decode = self._generate if self.model is not None else self._generate_stepwise
                texts = decode([prompts[i] for i in rows], max_gen, until, sampling, generators)
                for i, text in zip(rows, texts):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results

    def _generate(self, prompts: list[list[int]], max_gen: int, until: list[str], sampling: Sampling | None,
                  generators: list[torch.Generator] | None) -> list[str]:
        """Decoding through the model's caches (a whole model on this rank)."""
        self.poll()
        ids, padding = pad_rows(prompts, self.mf_tokenizer.pad_id, left=True, device=self.device)
        start = ids.shape[1]

        def stopped(tokens: torch.Tensor) -> torch.Tensor:
            texts = [self.tok_decode(row) for row in tokens[:, start:].tolist()]
            return torch.tensor([any(stop in text for stop in until) for text in texts], device=tokens.device)

        choose = None
        if sampling is not None and generators is not None:
            def choose(logits: torch.Tensor) -> torch.Tensor:
                return sampling.pick(logits, generators).to(logits.device)

        assert self.model is not None
        with sdpa_attention(self.model):
            out = greedy_decode(self.model, ids, max_gen, prompt_padding=padding, eos_id=self.eot_token_id,
                                stopped=stopped, between_tokens=self.poll, choose=choose)
        return [self._text(row, until) for row in out[:, start:].tolist()]

    def _generate_stepwise(self, prompts: list[list[int]], max_gen: int, until: list[str],
                           sampling: Sampling | None, generators: list[torch.Generator] | None) -> list[str]:
        """Decoding through the layout's evaluation forward: each step runs the whole prefix of every unfinished
        row (no cache); every rank gets the same logits, so every rank picks the same tokens and stops alike."""
        assert self.next_logits is not None
        sequences = [list(p) for p in prompts]
        new: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        for _ in range(max_gen):
            if not active:
                break
            self.poll()
            logits = self.next_logits([sequences[i] for i in active])
            if sampling is None or generators is None:
                tokens = logits.argmax(-1)
            else:
                tokens = sampling.pick(logits, [generators[i] for i in active])
            still = []
            for i, token in zip(active, tokens.tolist()):
                if token == self.eot_token_id:
                    continue
                sequences[i].append(token)
                new[i].append(token)
                if not any(stop in self.tok_decode(new[i]) for stop in until):
                    still.append(i)
            active = still
        return [self._text(row, until) for row in new]

    def _text(self, row: list[int], until: list[str]) -> str:
        if self.eot_token_id in row:
            row = row[:row.index(self.eot_token_id)]
        return postprocess_generated_text(self.tok_decode(row), until, None)


class Sampling:
    """lm-eval's sampling options (`do_sample: true`, `temperature` > 0, `top_k`, `top_p`), applied as Hugging Face's
    `generate` applies them: logits / temperature, then the top_k tokens, then the smallest set of tokens whose
    probability reaches top_p."""

    def __init__(self, temperature: float, top_k: int, top_p: float) -> None:
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Sampling | None:
        """The options' sampling (None: greedy); one line for an option meshformer does not apply."""
        do_sample = bool(options.pop("do_sample", False))
        given = {key: options.pop(key, None) for key in ("temperature", "top_k", "top_p", "num_beams")}
        temperature = float(0.0 if given["temperature"] is None else given["temperature"])  # None: the default
        top_k = int(0 if given["top_k"] is None else given["top_k"])
        top_p = float(1.0 if given["top_p"] is None else given["top_p"])
        if int(1 if given["num_beams"] is None else given["num_beams"]) != 1:
            raise UsageError("meshformer's lm-eval model does not run beam search (num_beams > 1)",
                             "set num_beams: 1 in the task's generation_kwargs")
        if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
            raise UsageError(f"generation_kwargs temperature={temperature}, top_k={top_k}, top_p={top_p}",
                             "use temperature >= 0, top_k >= 0 and 0 < top_p <= 1")
        if not do_sample or temperature == 0.0:  # lm-eval's greedy: do_sample false or temperature 0
            return None
        return cls(temperature, top_k, top_p)

    def pick(self, logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        """One token per row, drawn by inverse CDF with the row's generator (one uniform per token, so a row's
        draws do not depend on the other rows)."""
        scores = logits.detach().to("cpu", torch.float64) / self.temperature
        vocab = scores.shape[-1]
        if 0 < self.top_k < vocab:
            kth = scores.topk(self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, -torch.inf)
        if self.top_p < 1.0:
            ordered, order = scores.sort(dim=-1, descending=True)
            probs = ordered.softmax(-1)
            ahead = probs.cumsum(-1) - probs  # the probability of the tokens ranked above each one
            drop = torch.zeros_like(ahead, dtype=torch.bool).scatter(-1, order, ahead >= self.top_p)
            scores = scores.masked_fill(drop, -torch.inf)
        cdf = scores.softmax(-1).cumsum(-1)
        draws = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
        return torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None]).clamp(max=vocab - 1)[:, 0]


def request_seeds(requests: list[Any], seed: int) -> list[int]:
    """Each request's sampling seed: `seed` with its task, document, index within the document and repeat (the
    n-th identical request: lm-eval repeats a request `repeats` times), not its place in the list."""
    seen: dict[str, int] = {}
    seeds = []
    for req in requests:
        identity = (f"{getattr(req, 'task_name', None)}|{getattr(req, 'doc_id', None)}|{getattr(req, 'idx', 0)}|"
                    f"{req.args[0]}")
        repeat = seen.get(identity, 0)
        seen[identity] = repeat + 1
        digest = hashlib.sha256(f"{seed}|{identity}|{repeat}".encode()).digest()
        seeds.append(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return seeds


def _generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator
