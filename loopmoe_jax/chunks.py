"""A dispatch over consecutive token chunks, each recomputed in its own backward, so that no
buffer sized for the dropless worst case outlives its chunk (run.expert_block_rows).

    chunks = token_chunks(t, k, num_experts, n, block_rows)      # 1: run whole
    y_ctD = in_token_chunks(body, chunks, params, x_TD, experts_Tk, weights_Tk)

`dropless_rows` is that worst case: the rows t tokens may deliver to one of n devices.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def dropless_rows(t: int, k: int, num_experts: int, n: int = 1) -> int:
  """The most rows t tokens (top-k of `num_experts`) may deliver to one of n devices holding
  E/n experts each: t * min(k, E/n) (a token sends at most one row per local expert, and at
  most k); n = 1: the t*k routed rows."""
  return t * min(k, num_experts // n)


def token_chunks(t: int, k: int, num_experts: int, n: int, block_rows: int) -> int:
  """How many consecutive token chunks t tokens run in so that one chunk's dropless buffer
  (n * dropless_rows: the routed rows on one device, the receive buffer under expert
  parallelism over n) holds at most `block_rows` rows: ceil(t / c_t) for the c_t =
  block_rows // (n * min(k, E/n)) tokens such a buffer holds (at least 1); 1 when block_rows
  is 0 or the whole buffer already fits. `in_token_chunks` pads t up to a multiple of it. A
  `block_rows` under one token's rows is refused (ValueError naming run.expert_block_rows)."""
  per_token = n * dropless_rows(1, k, num_experts, n)
  if not block_rows or t * per_token <= block_rows:
    return 1
  if block_rows < per_token:
    raise ValueError(f'run.expert_block_rows={block_rows}: one token alone fills {per_token} '
                     f'rows of a chunk\'s buffer here ({n} device(s) x min(top_k={k}, '
                     f'{num_experts // n} experts per device)); use at least {per_token}, or 0')
  return -(-t // (block_rows // per_token))


def in_token_chunks(body, chunks: int, params, x_TD, experts_Tk, weights_Tk):
  """body(params, x, experts, weights) over `chunks` consecutive equal slices of the tokens,
  in a scan, each slice under `jax.checkpoint`: the backward keeps a chunk's inputs only and
  reruns its forward, so no buffer of `body` outlives its chunk. The tokens are padded up to
  chunks x ceil(t / chunks) (a padded token: zeros routed to experts 0..k-1, distinct as a
  real token's, with weight 0, so it adds nothing and fits every dropless bound); the outputs
  come stacked over the chunks ([chunks, rows, ...]: the caller drops the rows past t).
  `params` enter the scan in float32 and are cast back inside each chunk, so their gradients
  sum over the chunks in float32 (as the whole dispatch's matmuls accumulate them), rounded
  once."""
  (t, k), rows = experts_Tk.shape, -(-experts_Tk.shape[0] // chunks)
  pad = chunks * rows - t
  if pad:
    x_TD = jnp.pad(x_TD, ((0, pad), (0, 0)))
    fill = jnp.broadcast_to(jnp.arange(k, dtype=experts_Tk.dtype), (pad, k))
    experts_Tk = jnp.concatenate([experts_Tk, fill])
    weights_Tk = jnp.pad(weights_Tk, ((0, pad), (0, 0)))
  return scan_chunks(body, chunks, params, x_TD, experts_Tk, weights_Tk)


def scan_chunks(body, chunks: int, params, *xs):
  """body(params, *slices) over `chunks` equal slices of each of `xs` (leading dimensions a
  multiple of it), in a scan, each under `jax.checkpoint`, outputs stacked [chunks, ...];
  `params` enter in float32 and are cast back inside, so their gradients sum over the
  chunks in float32."""
  dtypes = jax.tree.map(lambda p: p.dtype, params)
  wide = jax.tree.map(lambda p: p.astype(jnp.promote_types(p.dtype, jnp.float32)), params)

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def chunk(wide, *xs):
    return body(jax.tree.map(lambda w, dt: w.astype(dt), wide, dtypes), *xs)

  split = lambda a: a.reshape(chunks, a.shape[0] // chunks, *a.shape[1:])
  _, out = jax.lax.scan(lambda _, xs: (None, chunk(wide, *xs)), None,
                        tuple(split(a) for a in xs))
  return out
