"""Every parallel layout against a single process: loss, step-0 gradients and the global norm within 1e-5 (Muon
rows: the updated weights too).

Launches of 2, 4 and 8 gloo processes on CPU run all layouts, one process group each (world 2 in two launches: the
default run's rows and the slow run's, WORLD2_SLOW); see helpers/parallel.py for what is compared. fp32
throughout, except the FSDP mixed-precision check.
"""

from __future__ import annotations

import pytest
from helpers.parallel import launch

TOL = 1e-5

WORLD2 = [
    # FSDP over 2 ranks, every family
    "decoder/fsdp", "encoder/fsdp", "encdec/fsdp",
    # tensor + sequence parallel, vocab-parallel loss; ALiBi slopes follow the head sharding
    "decoder/tp", "decoder_alibi/tp", "encoder/tp", "encdec/tp",
    "decoder_qwen/tp",  # head_dim, QK-norm, Q/K/V-only biases, llama3 RoPE scaling under head sharding
    # Gemma's block options (sandwich norms, window pattern with two RoPE bases, soft-capping) under every axis;
    # OLMo 2's whole-projection QK-norm and post-sublayer norms with each sequence split
    "decoder_gemma/tp", "decoder_gemma/fsdp", "decoder_gemma/cp", "decoder_gemma/pp-sched=1f1b", "decoder_olmo2/cp",
    "decoder_olmo2/tp",  # QK-norm over whole projections: each rank its heads' weight slice, mean square summed
    # OLMo 3: the window pattern with its two RoPE bases under every axis (each pipeline stage's blocks keep their
    # place in the pattern; each context-parallel piece its place in the sequence)
    "olmo3/tp", "olmo3/fsdp", "olmo3/pp", "olmo3/cp",
    # pipeline: every schedule (2 stages per rank for the interleaved / V ones)
    "decoder/pp-sched=gpipe", "decoder/pp-sched=1f1b", "decoder/pp-sched=interleaved_1f1b-spr=2",
    "decoder/pp-sched=interleaved_zb-spr=2", "decoder/pp-sched=zbv",
    "encoder/pp-sched=1f1b", "encoder/pp-sched=zbv",
    # encoder-decoder: split at the stack boundary, inside the decoder (memory travels with the decoder
    # stream), and 4 stages of one layer each (encoder-only, boundary and decoder-only stages)
    "encdec/pp-sched=1f1b", "encdec/pp-sched=gpipe-split=3", "encdec/pp-sched=zbv",
    "encdec/pp-sched=interleaved_zb-spr=2", "encdec/pp-sched=interleaved_1f1b-spr=2-mb=4",
    # recomputation composes with every axis
    "decoder/fsdp-recompute=selective", "encdec/tp-recompute=full", "decoder/pp-recompute=every_k",
    "decoder/pp-sched=interleaved_zb-spr=2-recompute=full",
    "loss/vocab_parallel",
    # the plain full-logits loss (layouts above use the chunked head loss, vocab-parallel under TP, run by the
    # last stage under PP)
    "decoder/fsdp-loss=plain", "decoder/tp-loss=plain", "decoder/pp-sched=1f1b-loss=plain",
    "encdec/pp-sched=zbv-loss=plain",
    # the chunked loss that recomputes its logits in the backward (auto under gpipe and interleaved_zb above):
    # vocab-parallel, and under ZBV's split backward; the stored-gradient chunked loss under GPipe
    "decoder/tp-loss=chunked_recompute", "decoder/pp-sched=zbv-loss=chunked_recompute",
    "decoder/pp-sched=gpipe-loss=chunked",
    # context parallel: each sequence in 4 pieces, 2 per rank, K/V all-gathered; RoPE, ALiBi, learned positions,
    # T5 buckets and a sliding window at each token's place in the sequence
    "decoder/cp", "decoder_alibi/cp-loss=plain", "gpt/cp", "decoder_t5/cp", "decoder_window/cp",
    # bidirectional (BERT-like, padded batches: the padding mask stays whole, each piece attends to every key);
    # a causal batch with its padding mask
    "encoder/cp", "decoder/cp-padded",
    "decoder/cp-compile",  # per-block torch.compile: the lower-right causal mask as a tensor inside the graph
    "decoder/tp-compile",  # compiled blocks take a sequence-parallel input: the embedding's gradient flows back
    # packed documents (model.document_mask): doc_ids travel to every pipeline stage and stay whole under cp
    "decoder_docs/fsdp", "decoder_docs/tp", "decoder_docs/pp-sched=1f1b", "decoder_docs/cp",
    # Qwen3.5's split projections: Gated DeltaNet heads under tensor parallel (in_proj_qkv and the convolution
    # picked per head), and a right-padded batch of the hybrid model under context parallel
    "qwen35/tp", "qwen35/cp-rightpad",
    "olmohybrid/tp",  # OLMo hybrid's separate projections split colwise, its q/k/v taps picked per head
    # Mamba-2 beside attention: the state and convolution window passed piece to piece (cp, right-padded too),
    # split by heads and groups (tp: in_proj and the convolution picked per head), FSDP and the pipeline
    "mamba/cp", "mamba/cp-rightpad", "mamba/tp", "mamba/fsdp", "mamba/pp",
]
WORLD4 = [
    "decoder/hsdp", "encoder/hsdp",
    "decoder/tp-fsdp", "encoder/tp-fsdp", "encdec/tp-fsdp",
    "decoder/pp-fsdp", "encoder/pp-fsdp", "encdec/pp-fsdp-sched=zbv", "decoder/pp-fsdp-sched=interleaved_zb-spr=2",
    "decoder/pp-fsdp-wholestage",  # parallel.pp_fsdp_unsharded_microbatches: torch's own PP x FSDP
    "decoder/pp-tp", "encoder/pp-tp", "encdec/pp-tp", "decoder/pp-tp-sched=zbv",
    "decoder/pp-tp-sched=interleaved_zb-spr=2",  # vocab-parallel recomputing head loss, split backward
    # 4 stages: the tied embedding/output pair lives on pipeline ranks 0 and 3, synced over their own group
    "decoder/pp=4-sched=1f1b", "encdec/pp=4-sched=gpipe",
    # context parallel x FSDP (parameters sharded over dp_shard x cp; selective recompute), x TP+SP, x PP
    "decoder/cp-fsdp", "decoder_alibi/cp-fsdp-recompute=selective", "decoder/cp-tp", "decoder/cp-pp-sched=zbv",
    "decoder/cp=4",  # 8 pieces of 2 tokens
    "encoder/cp-fsdp",
    "decoder_olmo2/tp-fsdp",
    "qwen35/cp-tp",  # Gated DeltaNet pieces in sequence order on each rank's heads
]
WORLD8 = ["decoder/pp-fsdp-tp", "encdec/pp-fsdp-tp-sched=interleaved_1f1b-spr=2",
          "decoder/cp-hsdp", "decoder/cp-pp-tp"]  # context parallel with HSDP; all of pp x cp x tp
# Mixture of experts (helpers/parallel.py: moe*): balance losses over the whole micro-batch; expert parallelism (ep)
# over dp_shard x cp x tp, composed with FSDP/HSDP (experts sharded over the data-parallel ranks ep leaves), TP+SP
# (ep spans the tensor-parallel ranks), CP and every pipeline schedule; a rank whose experts receive no token
# (moe_skew); per-sequence balance loss; the bias balancing after each step with its global loads (moe_bias);
# a pipeline stage without MoE layers (moe_late: every rank still creates the MoE meshes' process groups)
MOE_WORLD2 = ["moe/fsdp", "moe/fsdp-ep", "moe/tp-ep", "moe/cp-ep", "moe/pp", "moe_late/pp", "moe_skew/fsdp-ep",
              "moe_seq/fsdp-ep", "moe_bias/fsdp-ep", "moe_bias/tp-ep", "moe/fsdp-ep-recompute=full",
              "moe/tp-ep-recompute=selective",
              # per-block torch.compile, all-to-alls inside the graph (the GPU's fast path); with selective recompute
              "moe/fsdp-ep-compile", "moe/tp-ep-compile", "moe/fsdp-ep-compile-recompute=selective",
              "moe_encdec/fsdp-ep", "moe_encdec/tp-ep", "moe_encdec/pp",  # MoE in both stacks
              # gpt-oss's pieces: sinks split with the heads (tp) and beside the gathered keys (cp), expert biases
              # split with the experts (ep), the sinks and biases outside Muon
              "gptoss/tp-ep", "gptoss/cp-ep", "gptoss/fsdp-ep", "gptoss/pp", "gptoss/tp-ep-muon",
              # DeepSeek-V3's pieces: multi-head latent attention split by heads (tp; the shared rotary key's
              # gradient summed over the ranks), its compressed latents exchanged (cp); DeepSeek's routing
              "deepseek/tp-ep", "deepseek/cp-ep", "deepseek/fsdp-ep", "deepseek/pp", "deepseek/tp-ep-muon",
              # multi-token prediction: its module (an MoE block) one FSDP unit with its experts split over ep; its
              # ids and targets k ahead taken from the whole sequence before the cp split, its block's attention
              # exchanging latents like the main blocks'
              "deepseek_mtp/fsdp-ep", "deepseek_mtp/cp-ep",
              # under tp: its block split like the main blocks, on sequence shards; the norms and eh_proj replicated
              "deepseek_mtp/tp-ep",
              # under pp: the modules on the last stage with its own copy of the embedding, the copies' gradients
              # summed as a tied embedding's; 1F1B and GPipe
              "deepseek_mtp/pp", "deepseek_mtp/pp-sched=gpipe",
              # its block recomputed as the main blocks are
              "deepseek_mtp/fsdp-ep-recompute=full", "deepseek_mtp/fsdp-ep-recompute=selective",
              # Qwen3-Next's pieces: linear_attention blocks (packed documents) under FSDP, expert, pipeline and
              # context parallel (the recurrent state and convolution window passed piece to piece in sequence
              # order, the attention blocks beside them on the balanced layout)
              "qwen3next/fsdp-ep", "qwen3next/pp", "qwen3next/fsdp-ep-recompute=selective",
              "qwen3next/fsdp-ep-recompute=full", "qwen3next/cp", "qwen3next/cp-ep",
              "qwen3next/tp-ep",  # Gated DeltaNet split by key-head group; its convolution picked per head
              # right-padded with packed documents: a padding query whose document has no real token attends to
              # the keys up to its own, as a context-parallel piece sees them (MoE routes its output)
              "qwen3next/cp-ep-rightpad",
              # the V and interleaved schedules (two stages per rank, split backward) with latent attention and
              # with Gated DeltaNet beside attention: four-block models
              "deepseek4/pp-sched=zbv", "deepseek4/pp-sched=interleaved_zb-spr=2",
              "deepseek4/pp-sched=interleaved_1f1b-spr=2", "qwen3next4/pp-sched=zbv",
              "qwen3next4/pp-sched=interleaved_zb-spr=2", "qwen3next4/pp-sched=gpipe",
              # Kimi Linear's pieces: KDA split by heads (q, k, v, their convolutions and the per-channel decay's
              # dt_bias with their heads), its per-channel state passed piece to piece (cp), beside latent attention
              # without RoPE; under FSDP and the pipeline
              "kimi/tp-ep", "kimi/cp-ep", "kimi/fsdp-ep", "kimi/pp",
              # multi-token prediction under the split backward: the last stage's weight pass keeps its graph
              "deepseek_mtp4/pp-sched=zbv", "deepseek_mtp4/pp-sched=interleaved_zb-spr=2",
              "deepseek_mtp4/pp-sched=interleaved_1f1b-spr=2",
              # DeepSeek Sparse Attention: the indexer's loss through FSDP, its scores' gradient summed over tp ranks,
              # its keys exchanged with the latents under cp (the same keys selected per piece), the loss joining on
              # each pipeline stage; the dense warm-up training only the indexers under FSDP
              "dsa/fsdp-ep", "dsa/tp-ep", "dsa/cp-ep", "dsa/pp", "dsa_warmup/fsdp-ep",
              # recomputed: the indexer's loss joins again from the replayed forward
              "dsa/fsdp-ep-recompute=full", "dsa/tp-ep-recompute=selective",
              # the warm-up's frozen parameters stay frozen under tp's styles and out of the pipeline's shared-weight
              # sum
              "dsa_warmup/tp-ep", "dsa_warmup/pp",
              # mHC: its mixing weights sharded by FSDP; cp pieces each mixing their own tokens' streams
              "deepseek_mhc/fsdp-ep", "deepseek_mhc/cp-ep",
              # mHC under tp: each rank's tokens' streams, the mixing weights' gradients summed over the ranks
              "deepseek_mhc/tp-ep",
              # GLM-5's shared selection handed from block 0 to block 1 through FSDP's wrapped calls, read again when
              # block 1 is recomputed after block 2 (which selects its own)
              "dsa_shared/fsdp-ep-recompute=full",
              # Nemotron-H's layers, one mixer each: blocks whose other sub-layer is "none" split by heads (tp) and
              # by sequence pieces (cp), its sigmoid group-routed squared-ReLU experts split over ep
              "nemotron/tp-ep", "nemotron/cp-ep",
              # DeepSeek-V4's attention kinds under tp + sp: query heads, sinks and output groups split, the one
              # key/value head, compressors and indexer whole on every rank (the key/value head's gradient summed),
              # hash routing on each rank's slice of the token ids, mHC's streams sequence-parallel
              "v4/tp-ep",
              # each rank's queries against the all-gathered key/value head, compressed entries and indexer keys
              # (entries compressed piece by piece), hash routing on each piece's ids
              "v4/cp"]
MOE_WORLD4 = ["qwen3next/cp=4",  # 8 pieces of 2 tokens: a convolution window spans two earlier pieces
              "qwen3next/cp-fsdp-ep=4", "qwen3next/tp-fsdp-ep",
              "moe/fsdp=4-ep", "moe/fsdp=4-ep=4", "moe/hsdp-ep", "moe/tp-fsdp-ep", "moe/tp-fsdp-ep=4",
              "moe/cp-fsdp-ep=4", "moe/pp-tp-ep", "moe/pp-fsdp-ep", "moe/pp-fsdp-ep-sched=gpipe",
              "moe/pp-fsdp-ep-sched=zbv", "moe/pp-fsdp-ep-sched=interleaved_1f1b-spr=2",
              "moe/pp-fsdp-ep-sched=interleaved_zb-spr=2", "moe_skew/fsdp=4-ep=4", "moe_seq/cp-fsdp-ep",
              "moe_bias/pp-fsdp-ep",
              # the experts' FSDP shards inside each block's unit: selective recompute replays it
              "moe/fsdp=4-ep-recompute=selective",
              # multi-token prediction with two axes: the last stage's modules split by tp; cp pieces under tp
              "deepseek_mtp/pp-tp-ep", "deepseek_mtp/cp-tp-ep=4",
              # KDA: 8 pieces of 2 tokens (a convolution window spans two earlier pieces); pieces on each rank's heads
              "kimi/cp=4", "kimi/cp-tp-ep=4",
              # Mamba-2: 8 pieces of 2 tokens (a convolution window across two earlier pieces); pieces on each
              # rank's heads; heads split under FSDP
              "mamba/cp=4", "mamba/cp-tp", "mamba/tp-fsdp"]
MOE_WORLD8 = ["moe/pp-fsdp-tp-ep", "moe/cp-tp-fsdp-ep=4", "moe/hsdp-tp-ep"]
WORLD2 += MOE_WORLD2
WORLD4 += MOE_WORLD4
WORLD8 += MOE_WORLD8
# optim.name="muon": Muon's matrices whole on every rank for Newton-Schulz (FSDP/TP shards gathered, experts on
# their expert-parallel rank, each pipeline stage its own); the matrices after two clipped steps are compared too
MUON_WORLD2 = ["decoder/fsdp-muon", "decoder/tp-muon", "decoder/pp-sched=1f1b-muon", "decoder/cp-muon",
               "moe/fsdp-ep-muon", "moe/tp-ep-muon", "encdec/tp-muon"]
# Newton-Schulz's gain near a zero singular value is a^5 = 3.4445^5 ~ 480: a nearly low-rank update (encoder blocks
# of encdec) turns a 1e-7 reduction-order difference into up to ~3e-5 of the matrix's scale (a unit test of the
# same: 1e-7 in, 2.9e-5 out). A wrong shard, matrix or scale is off by 1e-2 or more.
MUON_WEIGHT_TOL = 1e-4
MUON_WORLD4 = ["decoder/hsdp-muon", "decoder/tp-fsdp-muon", "moe/tp-fsdp-ep-muon", "decoder/pp-fsdp-muon"]
WORLD2 += MUON_WORLD2
WORLD4 += MUON_WORLD4
# optim.name="normuon" (optim/normuon.py): Muon's layouts plus the per-neuron second moment summed over the ranks
# that share a matrix (dense under FSDP and TP; stacked experts' neurons under FSDP x EP)
NORMUON_WORLD2 = ["decoder/fsdp-normuon", "decoder/tp-normuon", "moe/fsdp-ep-normuon"]
WORLD2 += NORMUON_WORLD2
# MuonClip (optim.qk_clip_threshold): each head's largest logit reduced (MAX) over data- and context-parallel ranks,
# tensor-parallel ranks scaling the rows of their own heads, FSDP ranks the rows of their shards; the same heads clip
# as in one process (grouped-query decoder: queries only; encdec: multi-head, queries and keys with their biases;
# deepseek: mla, the heads' position-free query and key rows and rotary query rows, split by heads under tp)
QK_CLIP_WORLD2 = ["decoder/fsdp-muon-qkclip", "decoder/tp-muon-qkclip", "decoder/cp-muon-qkclip",
                  "encdec/tp-muon-qkclip=0.02", "decoder/fsdp-muon-qkclip-compile",  # compiled: the math path
                  "deepseek/tp-ep-muon-qkclip", "deepseek/fsdp-muon-qkclip"]
QK_CLIP_WORLD4 = ["decoder/tp-fsdp-muon-qkclip", "decoder/pp-fsdp-muon-qkclip"]
WORLD2 += QK_CLIP_WORLD2
WORLD4 += QK_CLIP_WORLD4
# parallel.cp_method="ulysses": each mixer's inputs all-to-all from sequence pieces to head shards over whole
# sequences and back; every kind it splits (full attention with GQA, document masks, sliding windows with sinks
# split with the heads (gptoss), MLA, Gated DeltaNet, KDA) and with EP, TP (MLA and KDA heads split twice) and
# FSDP. cp=4: 8 pieces reordered, 2 key/value heads repeated up to 4. All slow (the world-2 rows in the slow launch).
ULYSSES_WORLD2 = ["decoder/cp-ulysses", "decoder_docs/cp-ulysses", "gptoss/cp-ep-ulysses",
                  "deepseek/cp-ep-ulysses", "qwen35/cp-ulysses", "kimi/cp-ep-ulysses"]
ULYSSES_WORLD4 = ["decoder/cp=4-ulysses", "kimi/cp-tp-ep=4-ulysses", "qwen3next/cp-fsdp-ep=4-ulysses"]
# Mamba-2 (x, B, C and dt to whole sequences of a run of heads and groups) and multi-token prediction (its block
# exchanges as the main blocks do); world 4, matrix only: Mamba-2 with FSDP, and pipeline stages around Ulysses
ULYSSES_WORLD2 += ["mamba/cp-ulysses", "deepseek_mtp/cp-ulysses"]
ULYSSES_MATRIX_WORLD4 = ["mamba/cp-fsdp-ulysses", "decoder/pp-cp-ulysses", "deepseek_mtp/pp-cp-ulysses"]
WORLD2 += ULYSSES_WORLD2
WORLD4 += ULYSSES_WORLD4
# bf16 all-gathers; bf16 autocast with bf16 rows through the experts' all-to-all: close, not equal
MIXED_PRECISION = ["decoder/fsdp-mp", "moe/tp-ep-bf16"]
# train.fp8 through torchao's emulation against a single process with the same float8 linears. Tensorwise scales
# are per tensor, so the reference runs each data-parallel shard and pipeline microbatch as its own piece. Under
# TP the tensorwise recipe all-gathers activations and gradients in float8 (gloo carries them as bytes here).
FP8_WORLD2 = ["decoder/tp-fp8=tensorwise", "decoder_alibi/tp-fp8=tensorwise", "encdec/tp-fp8=tensorwise",
              "decoder/tp-fp8=rowwise", "decoder/fsdp-fp8=tensorwise",
              "decoder/fsdp-fp8=tensorwise-muon"]  # Muon steps torchao's float8 weights (FSDP all-gathers float8)
FP8_WORLD4 = ["decoder/tp-fsdp-fp8=tensorwise", "decoder/pp-tp-fp8=tensorwise", "encdec/tp-fsdp-fp8=rowwise"]
# Summation-order differences of ~1e-7 can move a value across a float8 rounding boundary (a step of 1/16 of
# it): gradients agree to 1e-2 (float8 against fp32 differs by 10-25%), losses to 1e-4. The second step's global
# norm sums gradients of weights that already moved apart by such crossings: 1e-3 (2.8e-4 seen, decoder_alibi/tp).
FP8_TOL, FP8_GRAD_TOL, FP8_NORM_TOL = 1e-4, 2e-2, 1e-3
# World-2 rows that only the slow run launches (a second world-2 launch): the costliest ones (torch.compile, torchao's
# float8 under TP, MoE variants of what the default launch checks without MoE). The default launch keeps a row of
# every family, axis, schedule, loss and recompute mode.
WORLD2_SLOW = {"decoder/cp-compile", "olmohybrid/tp", "decoder/tp-fp8=tensorwise", "decoder_alibi/tp-fp8=tensorwise",
               "encdec/tp-fp8=tensorwise", "decoder/tp-fp8=rowwise", "moe/tp-ep-bf16", "moe_encdec/tp-ep",
               "moe/fsdp-ep-recompute=full", "moe/tp-ep-recompute=selective", "moe_bias/tp-ep", "moe/fsdp-ep-compile",
               "moe/tp-ep-compile", "moe/fsdp-ep-compile-recompute=selective", "decoder/fsdp-fp8=tensorwise-muon",
               "decoder/cp-muon-qkclip", "encdec/tp-muon-qkclip=0.02", "decoder/fsdp-muon-qkclip-compile",
                "deepseek_mtp/fsdp-ep", "deepseek/fsdp-muon-qkclip", "deepseek_mtp/cp-ep",
                "deepseek_mtp/tp-ep", "deepseek_mtp/pp", "deepseek_mtp/pp-sched=gpipe",
                "deepseek4/pp-sched=zbv", "deepseek4/pp-sched=interleaved_zb-spr=2",
                "deepseek4/pp-sched=interleaved_1f1b-spr=2", "qwen3next4/pp-sched=zbv",
                "qwen3next4/pp-sched=interleaved_zb-spr=2", "qwen3next4/pp-sched=gpipe",
                "deepseek_mtp4/pp-sched=zbv", "deepseek_mtp4/pp-sched=interleaved_zb-spr=2",
                "deepseek_mtp4/pp-sched=interleaved_1f1b-spr=2", "deepseek_mtp/fsdp-ep-recompute=full",
                "deepseek_mtp/fsdp-ep-recompute=selective", "kimi/fsdp-ep", "kimi/pp", "dsa/fsdp-ep", "dsa/pp",
                "dsa_warmup/fsdp-ep", "dsa/fsdp-ep-recompute=full", "dsa/tp-ep-recompute=selective", "dsa_warmup/tp-ep",
                "dsa_warmup/pp", "mamba/cp", "mamba/cp-rightpad", "mamba/tp", "mamba/fsdp",
                "mamba/pp", "deepseek_mhc/fsdp-ep", "deepseek_mhc/cp-ep", "deepseek_mhc/tp-ep", "nemotron/tp-ep",
                "nemotron/cp-ep", "dsa_shared/fsdp-ep-recompute=full", "v4/tp-ep", "v4/cp",
                *NORMUON_WORLD2} | set(ULYSSES_WORLD2)
# The second step's global gradient norm, for rows where Adam's first update (about ±lr per element, its sign set by
# rounding where a gradient is near zero) moves the weights differently enough to show: step-0 gradients of these
# rows agree to 1e-6; measured 1.34e-5 on an AVX-512 CPU.
NORM_TOL = {"decoder_gemma/tp": 3e-5, "dsa_warmup/tp-ep": 5e-5}  # dsa_warmup: only the indexers' gradients (below)
# The indexer's gradient in its scores is softmax(I) - p, two near-equal distributions at initialisation (~1e-3 of
# either apart), so fp32 rounding of either shows ~1000-fold in it: under tp each rank's heads give their share
# (m_r softmax(I) - p_r) and the shares are summed (1.2e-5 of the indexer's gradient seen), under cp each piece's
# probabilities come from products of another shape (7.2e-6 seen). Without the sum over tp ranks: 0.79.
GRAD_TOL = {"dsa/tp-ep": 3e-5, "dsa/cp-ep": 3e-5, "dsa/tp-ep-recompute=selective": 3e-5, "dsa_warmup/tp-ep": 3e-5,
            # mHC's mixing biases: sums over every token's Sinkhorn-normalised mix, in each layout's order
            "deepseek_mhc/fsdp-ep": 3e-5, "deepseek_mhc/cp-ep": 3e-5, "deepseek_mhc/tp-ep": 3e-5,
            "deepseek_mhc/pp": 5e-5,  # 2.0e-5 seen (a join's bias), the streams crossing the stage boundary
            # the V4-like model's mHC biases alike: 7.3e-6 (tp), 1.4e-5 (pp, fsdp), 1.7e-5 (interleaved_zb) seen
            **dict.fromkeys(["v4/tp-ep", "v4/pp", "v4/fsdp-ep", "v4/tp-fsdp-ep", "v4/pp-tp-ep",
                             "v4/pp-sched=interleaved_zb-spr=2-recompute=full", "v4/tp-ep-recompute=selective",
                             "v4/tp-ep-muon", "v4/cp", "v4/cp-fsdp", "v4/cp-ep",
                             "v4/cp-rightpad", "v4/tp-ep-indexloss", "v4/cp-indexloss", "v4/tp-ep-indexwarmup",
                             "v4/pp-indexloss", "v4/cp-packed", "v4/cp-ulysses", "v4/cp-ulysses-packed",
                             "v4/cp-tp-ep=4-ulysses", "v4/cp-indexloss-packed", "v4/cp-ulysses-indexloss"], 3e-5),
            # left-padded rows: an mHC bias's gradient 2.6e-5 from one process's (1.9e-5 under FSDP alone, no cp);
            # the attention blocks' within 9e-7
            "v4/cp-leftpad": 5e-5,
            # the V4-like model with MTP: its module's merge weights and bias have gradients ~1e-5 of the model's
            # largest (sums over tokens that nearly cancel), so fp32 rounding shows against the 1e-4 floor: 3.6e-5
            # (fsdp, pp), 3.8e-5 (tp, pp x tp, tp x fsdp), 4.8e-5 (cp), 6.4e-5 (cp x tp) seen; the world-2 layouts
            # in float64 agree within 1.2e-13. Without the merge's gradient summed over the tp ranks: 9.4e-2
            **dict.fromkeys(["v4mtp/tp-ep", "v4mtp/fsdp-ep", "v4mtp/pp", "v4mtp/cp", "v4mtp/pp-tp-ep",
                             "v4mtp/tp-fsdp-ep", "v4mtp/cp-tp-ep=4"], 1e-4)}
ALL_WORLD2 = WORLD2 + MIXED_PRECISION + FP8_WORLD2 + ["skip/nan"]  # skip/nan: a NaN gradient on one rank


def default_or_slow(names: list[str], slow: set[str]) -> list:
    """`names` as parameters, those in `slow` marked slow (their reports come from a slow-only launch)."""
    return [pytest.param(name, marks=pytest.mark.slow) if name in slow else name for name in names]


@pytest.fixture(scope="module")
def world2():
    return launch(2, [name for name in ALL_WORLD2 if name not in WORLD2_SLOW])


@pytest.fixture(scope="module")
def world2_slow():
    return launch(2, [name for name in ALL_WORLD2 if name in WORLD2_SLOW])


def world2_report(request: pytest.FixtureRequest, name: str) -> dict:
    """Only the launch that holds `name` starts: the slow run never launches the default rows."""
    return request.getfixturevalue("world2_slow" if name in WORLD2_SLOW else "world2")[name]


@pytest.fixture(scope="module")
def world4():
    return launch(4, WORLD4 + FP8_WORLD4)


@pytest.fixture(scope="module")
def world8():
    return launch(8, WORLD8)


def check(report: dict, tol: float = TOL, grad_tol: float | None = None, name: str = "",
          norm_tol: float | None = None) -> None:
    assert "error" not in report, report.get("error")
    cp = [int(part.partition("=")[2] or 2) for part in name.split("/")[-1].split("-") if part.partition("=")[0] == "cp"]
    if cp:  # equal results alone would not show that sequences were split
        expected = f"{cp[0]} ranks, each holding 2 of {2 * cp[0]} pieces"
        assert report["kernels"]["context"].startswith(expected), report["kernels"]
        ulysses = "ulysses" in name.split("/")[-1].split("-")  # and by the method asked for
        assert ("Ulysses" in report["kernels"]["context"]) == ulysses, report["kernels"]
    ep = [int(part.partition("=")[2] or 2) for part in name.split("/")[-1].split("-") if part.partition("=")[0] == "ep"]
    if ep:  # equal results alone would not show that experts were split
        assert f"experts split over ep={ep[0]} ranks" in report["kernels"]["experts"], report["kernels"]
    assert report["missing"] == [], f"parameters no rank checked: {report['missing']}"
    if "compile" in name.split("/")[-1].split("-"):  # each block one graph: a break would run a recomputed one eagerly
        assert report["graph_breaks"] == {}, list(report["graph_breaks"])
    # every rank created the same process groups (moe_late/pp: a pipeline stage without MoE layers)
    assert len(set(report["group_counts"])) == 1, f"process groups created per rank: {report['group_counts']}"
    if name.startswith("moe_skew/"):  # the case it stands for happened: experts 2 and 3 saw no token on any rank
        assert report["expert_loads"][2:] == [0.0, 0.0] and min(report["expert_loads"][:2]) > 0
    assert max(report["loss_rel"]) < tol, f"loss relative diffs {report['loss_rel']}"
    # multi-token prediction: each module's mean loss at both steps (mtp/loss_<k>), every parameter of its modules
    # with a gradient
    assert max(report["mtp_rel"], default=0.0) < tol, f"mtp/loss_<k> relative diffs {report['mtp_rel']}"
    assert report["mtp_without_grad"] == [], f"MTP parameters without gradient: {report['mtp_without_grad']}"
    assert report["grad_rel"] < (grad_tol or tol), \
        f"gradient relative diff {report['grad_rel']:.3e} at {report['worst']}"
    assert report["norm_rel"] < (norm_tol or tol), f"global grad norm relative diff {report['norm_rel']:.3e}"
    # the matrices after both Muon/NorMuon steps (helpers/parallel.py: compare)
    if {"muon", "normuon"} & set(name.split("/")[-1].split("-")):
        weight_tol = max(MUON_WEIGHT_TOL, grad_tol or 0.0)  # float8: step 1's gradients already FP8_GRAD_TOL apart
        assert report["weight_rel"] is not None and report["weight_rel"] < weight_tol, \
            f"updated weights' relative diff {report['weight_rel']}"
        # each matrix orthogonalised by one rank: the ranks' shares add up to one process's count
        assert sum(report["ns_matrices"]) == report["ns_matrices_reference"] > 0, report["ns_matrices"]
    if {"indexloss", "indexwarmup"} & {part.partition("=")[0] for part in name.split("/")[-1].split("-")}:
        # the csa indexers' objective: its term reaches the indexers in one process, and every tensor-parallel
        # rank's loss (summed over the ranks of other tokens) is one process's at both steps
        assert report["indexer_grad_max"] > 0, "the indexers got no gradient from their loss"
        assert report["index_loss_rel"] is not None and report["index_loss_rel"] < tol, \
            f"csa indexer loss rel diff {report['index_loss_rel']} (one process: {report['index_loss_reference']})"
    if any(part.partition("=")[0] == "qkclip" for part in name.split("/")[-1].split("-")):
        # the same heads clipped at each step as in one process (some: the threshold lies among the logits), the
        # same largest logit; the weights after both steps are compared above
        ours, ref = report["qk_clip"], report["qk_clip_reference"]
        assert [heads for heads, _ in ours] == [heads for heads, _ in ref] and ref[0][0] > 0, (ours, ref)
        assert all(abs(a - b) <= tol * b for (_, a), (_, b) in zip(ours, ref, strict=True)), (ours, ref)


@pytest.mark.parametrize("name", default_or_slow(WORLD2, WORLD2_SLOW))
def test_parity_world2(request, name):
    check(world2_report(request, name), name=name, grad_tol=GRAD_TOL.get(name), norm_tol=NORM_TOL.get(name))


# World-2 rows CI leaves out for time (slow + matrix, their own launch): mHC's (B, T, streams, D) streams handed
# between pipeline stages; a dsa_shared block on the stage of the dsa block it reads; the V4-like model's stages
# (each with a hash-routed block: the token ids reach both; four one-block stages under the split backward,
# recomputed) and its FSDP units; under tp recomputed, and Muon's matrices gathered from the split heads and groups
WORLD2_MATRIX = ["deepseek_mhc/pp", "dsa_shared/pp", "v4/pp", "v4/fsdp-ep",
                 "v4/pp-sched=interleaved_zb-spr=2-recompute=full", "v4/tp-ep-recompute=selective", "v4/tp-ep-muon",
                 # under cp with expert parallel; right-padded (each piece's padding checked)
                 "v4/cp-ep", "v4/cp-rightpad",
                 # the csa indexers' objective (its loss per step and layer compared too): under tp + sp each rank's
                 # heads' mass on the entries summed over the ranks before it is normalised, the replicated indexer's
                 # gradient whole on every rank and not summed; under cp each rank's queries' share; the dense
                 # warm-up under tp (only the indexers train); joining on each pipeline stage
                 "v4/tp-ep-indexloss", "v4/cp-indexloss", "v4/tp-ep-indexwarmup", "v4/pp-indexloss",
                 # packed documents (runs over the whole sequence: entries pooled per document, each query reading
                 # its own) and left-padded rows (each rank reads the runs from the whole rows' padding); the csa
                 # indexers' objective over packed documents
                 "v4/cp-packed", "v4/cp-leftpad", "v4/cp-indexloss-packed",
                 # Ulysses: the query heads split over cp (sinks with them), the key/value head, the entries and the
                 # indexer's picks all-gathered; and over packed documents; the csa indexers' objective (the heads'
                 # mass summed over the cp ranks' head shards, each rank's loss over its own queries only)
                 "v4/cp-ulysses", "v4/cp-ulysses-packed", "v4/cp-ulysses-indexloss",
                 # its multi-token prediction module (a sliding-window block) reading the main stack's streams before
                 # their merge: under tp + sp (h_proj, e_proj and its merge on each rank's tokens, their gradients
                 # summed over the ranks; its block split as the main ones), its FSDP unit, on the last pipeline stage
                 # (the streams cross the stage boundary unmerged), and under cp (the tokens ahead from whole sequences)
                 "v4mtp/tp-ep", "v4mtp/fsdp-ep", "v4mtp/pp", "v4mtp/cp"]


@pytest.fixture(scope="module")
def world2_matrix():
    return launch(2, WORLD2_MATRIX)


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize("name", WORLD2_MATRIX)
def test_parity_world2_matrix(world2_matrix, name):
    check(world2_matrix[name], name=name, grad_tol=GRAD_TOL.get(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", WORLD4)
def test_parity_world4(world4, name):
    check(world4[name], name=name)


# The V4-like model with two axes: tp x FSDP (the split heads' and output groups' shards, the whole key/value head's
# and mHC's weights sharded by FSDP), pp x tp (each stage's heads split, its mHC streams on sequence slices) and
# cp with FSDP sharding parameters over dp_shard x cp; Ulysses under tp (each rank's heads split again: one a rank)
V4_MATRIX_WORLD4 = ["v4/tp-fsdp-ep", "v4/pp-tp-ep", "v4/cp-fsdp", "v4/cp-tp-ep=4-ulysses",
                    # its MTP module split by tp on the last pipeline stage, beside FSDP's shards, and on cp pieces
                    "v4mtp/pp-tp-ep", "v4mtp/tp-fsdp-ep", "v4mtp/cp-tp-ep=4"]


@pytest.fixture(scope="module")
def world4_matrix():
    return launch(4, ULYSSES_MATRIX_WORLD4 + V4_MATRIX_WORLD4)


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize("name", ULYSSES_MATRIX_WORLD4 + V4_MATRIX_WORLD4)
def test_parity_world4_matrix(world4_matrix, name):
    check(world4_matrix[name], name=name, grad_tol=GRAD_TOL.get(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", WORLD8)
def test_parity_world8_4d(world8, name):
    check(world8[name], name=name)


@pytest.mark.parametrize("name", default_or_slow(MIXED_PRECISION, WORLD2_SLOW))
def test_fsdp_bf16_params_close(request, name):
    check(world2_report(request, name), tol=3e-2)


@pytest.mark.parametrize("name", default_or_slow(FP8_WORLD2 + FP8_WORLD4, WORLD2_SLOW | set(FP8_WORLD4)))
def test_fp8_layouts_match_single_process_fp8(request, name):
    report = world2_report(request, name) if name in FP8_WORLD2 else request.getfixturevalue("world4")[name]
    check(report, tol=FP8_TOL, grad_tol=FP8_GRAD_TOL, norm_tol=FP8_NORM_TOL)
    tensorwise_tp = "tp" in name.split("/")[1].split("-") and name.endswith("tensorwise")
    # torchao's float8 styles ran: activations (and their gradients) were all-gathered in float8
    assert (report["float8_gathers"] > 0) == tensorwise_tp, report["float8_gathers"]
    assert report["kernels"]["fp8"].startswith("torchao float8")


def test_a_nan_on_one_rank_skips_the_update_on_every_rank(world2):
    report = world2["skip/nan"]
    assert "error" not in report, report.get("error")
    for rank in report["ranks"]:  # step 0 poisoned on rank 1 only; step 1 trains every parameter again
        assert rank == {"changed": [0, report["params"]], "skipped": 1, "finite": True}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["decoder/hsdp", "encoder/hsdp", "decoder/cp-hsdp"])
def test_hsdp_all_reduces_over_replicas_once_per_step(request, name):
    """Two micro-batches a step: the first only reduce-scatters, the last all-reduces the sum (parity above)."""
    counts = request.getfixturevalue("world8" if name in WORLD8 else "world4")[name]["replica_all_reduces"]
    assert counts[0] == counts[2] == 0 and counts[1] == counts[3] > 0, counts


def test_fsdp_float8_weight_scales_come_from_one_all_reduce_after_each_step(world2):
    """Step 1 scales each float8 weight at its all-gathers (an amax all-reduce each, forward and backward); from
    step 2 on every scale is ready (computed after the optimizer step), and the parity test above still holds."""
    counts = world2["decoder/fsdp-fp8=tensorwise"]["float8_amax_all_reduces"]
    assert counts[0] > 0 and counts[1] == 0, counts


@pytest.mark.parametrize("name", ["moe/pp", "moe/tp-ep"])
def test_every_moe_layer_reaches_the_run_log(world2, name):
    layers = {key.split("/")[1] for key in world2[name]["moe_scalars"]}
    assert layers == {"decoder_layers.1", "decoder_layers.2", "decoder_layers.3"}  # block 0 is dense


def test_layout_report_names_the_kernels(world2):
    kernels = world2["decoder/pp-sched=zbv"]["kernels"]
    assert kernels["layout"].startswith("pp=2")
    assert "zbv, 4 stages" in kernels["pipeline"]
    assert world2["decoder/fsdp-recompute=selective"]["kernels"]["recompute"].startswith("selective")
    assert world2["decoder/tp"]["kernels"]["loss"] == "chunked"  # vocab-parallel chunked head loss
    assert world2["decoder/tp-loss=plain"]["kernels"]["loss"].startswith("plain")
    assert world2["decoder/pp-sched=zbv"]["kernels"]["loss"] == "chunked"  # computed by the last stage
    # auto recomputes where the last stage holds several micro-batches' losses
    assert world2["decoder/pp-sched=gpipe"]["kernels"]["loss"] == "chunked_recompute"
    assert world2["decoder/pp-sched=interleaved_zb-spr=2"]["kernels"]["loss"] == "chunked_recompute"
    assert world2["decoder/pp-sched=1f1b-loss=plain"]["kernels"]["loss"].startswith("plain")
