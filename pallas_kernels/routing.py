"""Routing kernel: router logits -> top-k experts and weights, fused with the per-expert counts
and the stable expert-sorted position of every (token, choice) that dispatch needs.

scores = softmax(logits) (or sigmoid(logits) with score='sigmoid'); the k experts are chosen
on scores + bias (the bias only steers the choice: aux-loss-free balancing), the weights are
the chosen scores, renormalised over the k when asked. Ties go to the lower expert index, like
jax.lax.top_k. positions_Tk[t, j] is where assignment (t, j) lands in a stable sort of the
flattened T*k expert ids: offset of its expert + count of that expert in earlier token blocks
+ its rank inside its own block (a strictly-lower-triangular matmul). Every token block is
independent (one program each, 'parallel' on TPU, no cross-program state on GPU); the
per-block counts are prefix-summed in plain JAX.

Shapes padded for the GPU (Triton wants power-of-two blocks): E to a power of two >= 16 with
-inf logits (zero score, never chosen), k to a power of two, the token block to a power of
two. Gradient (jax.custom_vjp, plain JAX, float32): weights_Tk and scores_TE are
differentiable in the logits; the choice is piecewise constant, so the bias gets zero.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import metadata, ops


def _columns(values, width):
  """Stacks [block_t, 1] columns into [block_t, width] (zeros past len(values)); a select
  chain, since Triton's concatenate takes two operands only."""
  iota = jax.lax.broadcasted_iota(jnp.int32, (values[0].shape[0], width), 1)
  out = jnp.zeros(iota.shape, values[0].dtype)
  for j, v in enumerate(values):
    out = jnp.where(iota == j, v, out)
  return out


def _route_kernel(logits_ref, bias_ref, experts_ref, weights_ref, scores_ref, rank_ref,
                  counts_ref, *, top_k, renormalize, sigmoid, num_tokens, block_t):
  b = pl.program_id(0)
  logits = logits_ref[...].astype(jnp.float32)
  if sigmoid:
    scores = 1.0 / (1.0 + jnp.exp(-logits))
  else:
    scores = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
    scores = scores / jnp.sum(scores, axis=1, keepdims=True)
  scores_ref[...] = scores
  select = scores + bias_ref[...]
  num_experts = select.shape[1]
  iota_e = jax.lax.broadcasted_iota(jnp.int32, select.shape, 1)
  rows = b * block_t + jax.lax.broadcasted_iota(jnp.int32, (block_t, 1), 0)
  real = (rows < num_tokens).astype(jnp.float32)
  chosen, weights, onehots = [], [], []
  for _ in range(top_k):
    best = jnp.max(select, axis=1, keepdims=True)
    idx = jnp.min(jnp.where(select == best, iota_e, num_experts), axis=1, keepdims=True)
    hit = iota_e == idx
    chosen.append(idx)
    weights.append(jnp.sum(jnp.where(hit, scores, 0.0), axis=1, keepdims=True))
    onehots.append(jnp.where(hit, real, 0.0))
    select = jnp.where(hit, -jnp.inf, select)
  if renormalize:
    total = functools.reduce(jnp.add, weights)
    weights = [w / total for w in weights]
  width = experts_ref.shape[1]
  experts_ref[...] = _columns(chosen, width)
  weights_ref[...] = _columns(weights, width)
  # Rank of (t, j) among same-expert assignments before it in this block (t-major order).
  per_token = functools.reduce(jnp.add, onehots)  # 0/1: an expert is chosen once per token
  tri = (jax.lax.broadcasted_iota(jnp.int32, (block_t, block_t), 0)
         > jax.lax.broadcasted_iota(jnp.int32, (block_t, block_t), 1))
  before = jnp.dot(tri.astype(jnp.bfloat16), per_token.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)  # 0/1 operands: exact
  ranks = []
  for j in range(top_k):
    ranks.append(jnp.sum(onehots[j] * before, axis=1, keepdims=True))
    before = before + onehots[j]
  rank_ref[...] = _columns(ranks, width).astype(jnp.int32)
  counts_ref[...] = jnp.sum(per_token, axis=0, keepdims=True)


def _route_impl(logits_TE, bias_E, cfg):
  top_k, renormalize, score, block_t, target, interpret = cfg
  t, e = logits_TE.shape
  pow2 = metadata.next_pow2
  block_t = min(pow2(block_t), max(16, pow2(t)))
  pad_t, ep, kp = -t % block_t, max(16, pow2(e)), pow2(top_k)
  logits = jnp.pad(logits_TE, ((0, 0), (0, ep - e)), constant_values=-jnp.inf)
  logits = jnp.pad(logits, ((0, pad_t), (0, 0)))
  bias = jnp.pad(bias_E.reshape(1, e), ((0, 0), (0, ep - e)), constant_values=-jnp.inf)
  num_blocks = (t + pad_t) // block_t
  kernel = functools.partial(_route_kernel, top_k=top_k, renormalize=renormalize,
                             sigmoid=score == 'sigmoid', num_tokens=t, block_t=block_t)
  rows = lambda width: pl.BlockSpec((block_t, width), lambda b: (b, 0))
  if target == 'tpu':
    params = pltpu.CompilerParams(dimension_semantics=('parallel',))
  else:
    params = pltriton.CompilerParams(num_warps=4, num_stages=1)
  shape = lambda width, dtype: jax.ShapeDtypeStruct((t + pad_t, width), dtype)
  with jax.named_scope('route_kernel'):
    experts, weights, scores, rank, block_counts = pl.pallas_call(
        kernel, grid=(num_blocks,),
        in_specs=[rows(ep), pl.BlockSpec((1, ep), lambda b: (0, 0))],
        out_specs=[rows(kp), rows(kp), rows(ep), rows(kp),
                   pl.BlockSpec((None, 1, ep), lambda b: (b, 0, 0))],
        out_shape=[shape(kp, jnp.int32), shape(kp, jnp.float32), shape(ep, jnp.float32),
                   shape(kp, jnp.int32),
                   jax.ShapeDtypeStruct((num_blocks, 1, ep), jnp.float32)],
        compiler_params=params,
        interpret=ops.resolve_interpret(target, interpret))(logits, bias)
  experts, weights, rank = experts[:t, :top_k], weights[:t, :top_k], rank[:t, :top_k]
  scores = scores[:t, :e]
  with jax.named_scope('positions'):
    block_counts_BE = block_counts[:, 0, :e].astype(jnp.int32)
    counts = jnp.sum(block_counts_BE, axis=0)
    offsets_E = jnp.cumsum(counts) - counts
    before_BE = jnp.cumsum(block_counts_BE, axis=0) - block_counts_BE
    block_T1 = (jnp.arange(t, dtype=jnp.int32) // block_t)[:, None]
    positions = offsets_E[experts] + before_BE[block_T1, experts] + rank
  return dict(experts_Tk=experts, weights_Tk=weights, scores_TE=scores, counts_E=counts,
              positions_Tk=positions)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _route(logits_TE, bias_E, cfg):
  return _route_impl(logits_TE, bias_E, cfg)


def _route_fwd(logits_TE, bias_E, cfg):
  out = _route_impl(logits_TE, bias_E, cfg)
  return out, (out['scores_TE'], out['experts_Tk'], bias_E)


def _route_bwd(cfg, res, g):
  """weights -> (renormalisation) -> scattered into E columns -> softmax/sigmoid Jacobian."""
  _, renormalize, score, *_ = cfg
  scores_TE, experts_Tk, bias_E = res
  g_Tk = g['weights_Tk']
  if renormalize:
    raw_Tk = jnp.take_along_axis(scores_TE, experts_Tk, axis=1)
    total_T1 = jnp.sum(raw_Tk, axis=1, keepdims=True)
    g_Tk = (g_Tk - jnp.sum(g_Tk * raw_Tk, axis=1, keepdims=True) / total_T1) / total_T1
  iota_TE = jax.lax.broadcasted_iota(jnp.int32, scores_TE.shape, 1)
  g_TE = g['scores_TE']
  for j in range(experts_Tk.shape[1]):
    g_TE = g_TE + jnp.where(iota_TE == experts_Tk[:, j:j + 1], g_Tk[:, j:j + 1], 0.0)
  if score == 'sigmoid':
    d_TE = g_TE * scores_TE * (1.0 - scores_TE)
  else:
    d_TE = scores_TE * (g_TE - jnp.sum(g_TE * scores_TE, axis=1, keepdims=True))
  return d_TE, jnp.zeros_like(bias_E)


_route.defvjp(_route_fwd, _route_bwd)


def route(logits_TE, top_k: int, *, renormalize: bool = True, bias_E=None,
          score: str = 'softmax', block_t: int = 128, target: str | None = None,
          interpret=None, platform: str | None = None):
  """Returns dict(experts_Tk int32, weights_Tk f32, scores_TE f32, counts_E int32,
  positions_Tk int32); differentiable in logits_TE (weights, scores). `target` 'tpu'
  (Mosaic) or 'gpu' (Triton), None: the platform's (ops.resolve_target; `platform` the one the
  program is built for, None: this machine's). `interpret` None: interpret on CPU."""
  if score not in ('softmax', 'sigmoid'):
    raise ValueError(f'score={score!r}: must be softmax or sigmoid')
  if logits_TE.ndim != 2:
    raise ValueError(f'logits must be [T, E], got shape {logits_TE.shape}')
  t, e = logits_TE.shape
  if bias_E is not None and bias_E.shape != (e,):
    raise ValueError(f'bias_E shape {bias_E.shape}: must be ({e},), one per expert')
  if not 0 < top_k <= e:
    raise ValueError(f'top_k={top_k}: must be in [1, {e}]')
  bias = jnp.zeros((e,), jnp.float32) if bias_E is None else bias_E.astype(jnp.float32)
  cfg = (top_k, renormalize, score, block_t, ops.resolve_target(target, platform),
         ops.interpret_flag(interpret, platform))
  # float32 in: the cast's own VJP returns the gradient in the logits' dtype.
  return _route(logits_TE.astype(jnp.float32), bias.reshape(e), cfg)
