"""Token losses, summed so callers normalise by the global token count.

`cross_entropy` (full-vocabulary logits), `fused` (output projection + loss in chunks), `vocab_parallel`
(logits sharded over tensor-parallel ranks), `token_loss` (which of them a run uses, bound to this rank's shard) and
`objective` (`Loss`: the token loss plus the weighted auxiliary terms, the one object every layout calls).
"""
