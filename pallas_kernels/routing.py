"""Routing kernel: router logits -> top-k experts and weights, fused with the per-expert counts
and the stable expert-sorted position of every (token, choice) that dispatch needs.

scores = softmax(logits) (or sigmoid(logits) with score='sigmoid'); the k experts are chosen
on scores + bias (the bias only steers the choice: aux-loss-free balancing), the weights are
the chosen scores, renormalised over the k when asked. Ties go to the lower expert index, like
jax.lax.top_k. positions_Tk[t, j] is where assignment (t, j) lands in a stable sort of the
flattened T*k expert ids: offset of its expert + its rank among earlier assignments of the same
expert (a strictly-lower-triangular matmul over the token block plus a running count carried
across the sequential grid).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _route_kernel(logits_ref, bias_ref, experts_ref, weights_ref, scores_ref, rank_ref,
                  counts_ref, *, top_k, renormalize, sigmoid, num_tokens, block_t):
  b = pl.program_id(0)

  @pl.when(b == 0)
  def _zero():
    counts_ref[...] = jnp.zeros_like(counts_ref)

  logits = logits_ref[...].astype(jnp.float32)
  num_experts = logits.shape[1]
  if sigmoid:
    scores = jax.nn.sigmoid(logits)
  else:
    scores = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
    scores = scores / jnp.sum(scores, axis=1, keepdims=True)
  scores_ref[...] = scores
  select = scores + bias_ref[...].astype(jnp.float32)
  iota_e = jax.lax.broadcasted_iota(jnp.int32, select.shape, 1)
  rows = b * block_t + jax.lax.broadcasted_iota(jnp.int32, (block_t, 1), 0)
  real = (rows < num_tokens).astype(jnp.float32)
  tri = (jax.lax.broadcasted_iota(jnp.int32, (block_t, block_t), 0)
         > jax.lax.broadcasted_iota(jnp.int32, (block_t, block_t), 1)).astype(jnp.float32)
  chosen, weights, onehots = [], [], []
  for _ in range(top_k):
    best = jnp.max(select, axis=1, keepdims=True)
    idx = jnp.min(jnp.where(select == best, iota_e, num_experts), axis=1, keepdims=True)
    hit = iota_e == idx
    chosen.append(idx)
    weights.append(jnp.sum(jnp.where(hit, scores, 0.0), axis=1, keepdims=True))
    onehots.append(hit.astype(jnp.float32) * real)
    select = jnp.where(hit, -jnp.inf, select)
  w = jnp.concatenate(weights, axis=1)
  if renormalize:
    w = w / jnp.sum(w, axis=1, keepdims=True)
  experts_ref[...] = jnp.concatenate(chosen, axis=1)
  weights_ref[...] = w
  # Rank of (t, j) among same-expert assignments before it in flat (t-major) order.
  per_token = functools.reduce(jnp.add, onehots)
  before_rows = jnp.dot(tri, per_token, preferred_element_type=jnp.float32) + counts_ref[...]
  ranks, within = [], jnp.zeros_like(per_token)
  for j in range(top_k):
    ranks.append(jnp.sum(onehots[j] * (before_rows + within), axis=1, keepdims=True))
    within = within + onehots[j]
  rank_ref[...] = jnp.concatenate(ranks, axis=1).astype(jnp.int32)
  counts_ref[...] += jnp.sum(per_token, axis=0, keepdims=True)


def route(logits_TE, top_k: int, *, renormalize: bool = True, bias_E=None,
          score: str = 'softmax', block_t: int = 128, interpret=None):
  """Returns dict(experts_Tk int32, weights_Tk f32, scores_TE f32, counts_E int32,
  positions_Tk int32). `interpret` None: interpret on CPU."""
  if score not in ('softmax', 'sigmoid'):
    raise ValueError(f'score={score!r}: must be softmax or sigmoid')
  if interpret is None:
    interpret = jax.default_backend() == 'cpu'
  t, e = logits_TE.shape
  block_t = min(block_t, max(8, -(-t // 8) * 8))
  pad = -t % block_t
  logits = jnp.pad(logits_TE, ((0, pad), (0, 0))) if pad else logits_TE
  bias = (jnp.zeros((1, e), jnp.float32) if bias_E is None
          else bias_E.astype(jnp.float32).reshape(1, e))
  tp = t + pad
  kernel = functools.partial(_route_kernel, top_k=top_k, renormalize=renormalize,
                             sigmoid=score == 'sigmoid', num_tokens=t, block_t=block_t)
  rows = lambda width: pl.BlockSpec((block_t, width), lambda b: (b, 0))
  fixed = pl.BlockSpec((1, e), lambda b: (0, 0))
  with jax.named_scope('route_kernel'):
    experts, weights, scores, rank, counts = pl.pallas_call(
        kernel, grid=(tp // block_t,),
        in_specs=[rows(e), fixed],
        out_specs=[rows(top_k), rows(top_k), rows(e), rows(top_k), fixed],
        out_shape=[jax.ShapeDtypeStruct((tp, top_k), jnp.int32),
                   jax.ShapeDtypeStruct((tp, top_k), jnp.float32),
                   jax.ShapeDtypeStruct((tp, e), jnp.float32),
                   jax.ShapeDtypeStruct((tp, top_k), jnp.int32),
                   jax.ShapeDtypeStruct((1, e), jnp.float32)],
        interpret=interpret)(logits, bias)
  experts, weights, scores, rank = experts[:t], weights[:t], scores[:t], rank[:t]
  counts = counts[0].astype(jnp.int32)
  with jax.named_scope('positions'):
    offsets = jnp.cumsum(counts) - counts
    positions = offsets[experts] + rank
  return dict(experts_Tk=experts, weights_Tk=weights, scores_TE=scores, counts_E=counts,
              positions_Tk=positions)
