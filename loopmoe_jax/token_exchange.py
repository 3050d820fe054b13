"""The expert exchange by token rows: each token goes once to each device holding one of its
experts, is expanded to those experts there, and comes back as one combined row.

Per device (inside `jax.shard_map`, T tokens, top-k, n devices of E/n experts each):

  pairs    the (token, device) pairs a token's kept choices touch, ordered by device, then
           token (at most T * min(k, n) of them);
  send     each pair's hidden state once, with the pair's routing: for each of the k choices
           its local expert (E/n where the choice is not on that device) and its weight,
           float32, in one [pairs, 2k] array beside the rows;
  expand   the received rows to their local experts (sorted by expert, the grouped SwiGLU);
  combine  each row's experts weighted and summed on the device that ran them, in float32;
  return   one row per pair, summed per token at its source.

A token sends min(k, devices it touches) rows instead of k: SMELT's top-7 of 288 experts on
8 devices touches about 4.9 devices on average (uniform routing), so about 0.7 of the rows
go out, and the same fraction comes back. The result equals the assignment exchange's up to
the float summation order (a token's experts are summed per device first). Gradients flow
through the same steps backwards; gathers and their transposes are gathers (`spread`,
`collect`), never scatters.

Bounds: a source sends one device at most `slot` pairs; the receive buffer holds n * slot
rows and the expansion at most `expand_rows` (the callers' `Body.token_slot`,
`Body.expand_rows`). Pairs past a slot (the last tokens of that device's pairs) and expanded
rows past `expand_rows` (the last local experts') are dropped and counted as the assignments
they carry; dropless bounds drop nothing.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from loopmoe_jax import chunks as chunks_lib
from loopmoe_jax import dispatch as dispatch_lib


def exclusive_cumsum(x, axis=0):
  return jnp.cumsum(x, axis=axis) - x


def _pad_row(x_ND):
  return jnp.concatenate([x_ND, jnp.zeros((1, x_ND.shape[1]), x_ND.dtype)])


@jax.custom_vjp
def spread(x_ND, src_M, slots_NC):
  """out[m] = x[src[m]] (zero where src[m] == N). `slots_NC` lists, per row of x, the
  positions m that read it (M where fewer): the backward sums them by gathering (`collect`)."""
  del slots_NC
  return _pad_row(x_ND)[src_M]


def _spread_fwd(x_ND, src_M, slots_NC):
  return spread(x_ND, src_M, slots_NC), (src_M, slots_NC, jnp.zeros((0,), x_ND.dtype))


def _spread_bwd(res, g_MD):
  src_M, slots_NC, like = res
  return collect(g_MD, src_M, slots_NC).astype(like.dtype), None, None


spread.defvjp(_spread_fwd, _spread_bwd)


@jax.custom_vjp
def collect(y_MD, src_M, slots_NC):
  """out[n] = sum_c y[slots[n, c]] in float32 (positions M add nothing): the transpose of
  `spread`, whose forward is this one's backward."""
  del src_M
  return jnp.sum(_pad_row(y_MD)[slots_NC].astype(jnp.float32), axis=1)


def _collect_fwd(y_MD, src_M, slots_NC):
  return collect(y_MD, src_M, slots_NC), (src_M, slots_NC, jnp.zeros((0,), y_MD.dtype))


def _collect_bwd(res, g_ND):
  src_M, slots_NC, like = res
  return spread(g_ND, src_M, slots_NC).astype(like.dtype), None, None


collect.defvjp(_collect_fwd, _collect_bwd)


def _compact(slots_NX, width: int, sentinel: int):
  """The first `width` valid positions of each row (ascending; `sentinel` marks none)."""
  return jnp.sort(jnp.where(slots_NX < sentinel, slots_NX, sentinel), axis=1)[:, :width]


class Pairs(NamedTuple):
  """A device's (token, device) pairs in send order: the token of each send position
  (T where none or dropped), its destination (n where none or dropped) and rank among that
  destination's pairs, each token's send positions, the raw pairs per destination, the
  send rows [M, D] and routing [M, 2k], and the assignments the slot dropped."""
  src_M: jax.Array
  dest_M: jax.Array
  rank_M: jax.Array
  slots_Tc: jax.Array
  counts_n: jax.Array
  x_MD: jax.Array
  meta_Mk2: jax.Array
  dropped: jax.Array


def pairs(x_TD, experts_Tk, weights_Tk, keep_Tk, n: int, e_loc: int, slot: int,
          max_devices: int = 0) -> Pairs:
  """The send side: which (token, device) pairs go out, their rows and routing; at most
  min(k, n) pairs a token, or `max_devices` where the routing limits a token to that many
  devices (model.max_expert_devices over this mesh's expert axis)."""
  t, k = experts_Tk.shape
  kk = min(k, n, max_devices or n)
  m = t * kk
  with jax.named_scope('pairs'):
    dev_Tk = experts_Tk // e_loc
    hit_Tkn = keep_Tk[..., None] & (dev_Tk[..., None] == jnp.arange(n))
    to_Tn = jnp.any(hit_Tkn, axis=1)
    key = jnp.where(to_Tn, jnp.arange(n), n).reshape(-1)      # flat t * n + j
    order = jnp.argsort(key, stable=True)                      # by device, then token
    pos_Tn = dispatch_lib.inverse_permutation(order).reshape(t, n)
    counts_n = jnp.sum(to_Tn, axis=0).astype(jnp.int32)
    send_off = exclusive_cumsum(counts_n)
    sent_Tn = to_Tn & (pos_Tn - send_off < slot)
    dropped = jnp.sum(jnp.where(to_Tn & ~sent_Tn, jnp.sum(hit_Tkn, axis=1), 0))
    order_M = order[:m]
    t_M, j_M = order_M // n, order_M % n
    rank_M = jnp.arange(m) - send_off[j_M]
    ok_M = (jnp.arange(m) < jnp.sum(counts_n)) & (rank_M < slot)
    src_M = jnp.where(ok_M, t_M, t)
    slots_Tc = _compact(jnp.where(sent_Tn, pos_Tn, m), kk, m)
    x_MD = spread(x_TD, src_M, slots_Tc)
    hit_Mk = hit_Tkn[t_M, :, j_M] & ok_M[:, None]
    ids_Mk = jnp.where(hit_Mk, experts_Tk[t_M] - j_M[:, None] * e_loc, e_loc)
    w_Mk = jnp.where(hit_Mk, weights_Tk[t_M].astype(jnp.float32), 0.0)
    meta = jnp.concatenate([w_Mk, jax.lax.stop_gradient(ids_Mk.astype(jnp.float32))], axis=1)
  return Pairs(src_M, jnp.where(ok_M, j_M, n), rank_M, slots_Tc, counts_n, x_MD, meta,
               dropped.astype(jnp.int32))


def expand_and_combine(x_RD, meta_Rk2, valid_R, params, expand_rows: int, runtime,
                       block_rows: int = 0):
  """The destination: received rows through their local experts, each row's experts weighted
  and summed (float32 [R, D]); and the expanded rows dropped past `expand_rows`.

  `block_rows` r > 0 with dropless bounds (`expand_rows` = R min(k, E/n)) larger than r: the
  received rows run in consecutive chunks whose expansion holds at most r rows, each chunk
  recomputed in its own backward (`chunks.scan_chunks`): the exchange stays whole (one set
  of collectives), only the experts' buffers are chunked. A row's experts are the same
  whatever its chunk, so the outputs are the whole's."""
  r, k = meta_Rk2.shape[0], meta_Rk2.shape[1] // 2
  kk = min(k, params['gate'].shape[0])
  per = max(1, block_rows // kk)
  if not block_rows or expand_rows <= block_rows or expand_rows < r * kk or r <= per:
    return _expand_whole(x_RD, meta_Rk2, valid_R, params, expand_rows, runtime)
  chunks = -(-r // per)
  pad = chunks * per - r
  xs = [jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)) for a in (x_RD, meta_Rk2, valid_R)]
  run = lambda p, x, m, v: _expand_whole(x, m, v, p, per * kk, runtime)
  y_cRD, dropped_c = chunks_lib.scan_chunks(run, chunks, params, *xs)
  return y_cRD.reshape(-1, y_cRD.shape[-1])[:r], jnp.sum(dropped_c)


def _ffn_weighted(x_MD, w_M, sizes_G, params, backend: str, tile: int, runtime):
  """The grouped SwiGLU with each row's output scaled by w (float32 [M]), the scale applied to
  the hidden state before the down projection (the same product, rounded once in the hidden
  dtype): the backward takes w's gradient from the hidden state the projection keeps anyway,
  not from a kept copy of every output row [M, D]. A backend without a split hidden state
  ('reference') scales its outputs."""
  backend = dispatch_lib.resolve_backend(backend, runtime=runtime)
  sizes_G = sizes_G.astype(jnp.int32)
  with jax.named_scope('grouped_matmul'):
    if backend not in dispatch_lib.HIDDEN:
      out = dispatch_lib.FFNS[backend](x_MD, sizes_G, params, tile, runtime=runtime)
      return (out.astype(jnp.float32) * w_M[:, None]).astype(out.dtype)
    h_MF, down = dispatch_lib.HIDDEN[backend](x_MD, sizes_G, params, tile, runtime=runtime)
    hw_MF = (h_MF.astype(jnp.float32) * w_M[:, None].astype(jnp.float32)).astype(h_MF.dtype)
    return down(hw_MF, params['down'])


def _expand_whole(x_RD, meta_Rk2, valid_R, params, expand_rows: int, runtime):
  """`expand_and_combine` over all the received rows at once."""
  r, k = meta_Rk2.shape[0], meta_Rk2.shape[1] // 2
  e_loc = params['gate'].shape[0]
  with jax.named_scope('expand'):
    ids = jnp.where(valid_R[:, None], meta_Rk2[:, k:].astype(jnp.int32), e_loc).reshape(-1)
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=e_loc + 1)[:e_loc].astype(jnp.int32)
    kept = jnp.diff(jnp.minimum(jnp.cumsum(sizes), expand_rows), prepend=0)
    dropped = jnp.sum(sizes) - jnp.sum(kept)
    pos_Rk = dispatch_lib.inverse_permutation(order).reshape(r, k)
    slots = _compact(jnp.where((pos_Rk < jnp.sum(kept)) & (ids.reshape(r, k) < e_loc),
                               pos_Rk, expand_rows), min(k, e_loc), expand_rows)
    order_X = order[:expand_rows]
    live_X = jnp.arange(expand_rows) < jnp.sum(kept)
    src_X = jnp.where(live_X, order_X // k, r)
    w_X = jnp.where(live_X, meta_Rk2[:, :k].reshape(-1)[order_X], 0.0)
    x_XD = spread(x_RD, src_X, slots)
  run = runtime.run
  out_XD = _ffn_weighted(x_XD, w_X, kept, params, run.dispatch, run.dispatch_tile, runtime)
  with jax.named_scope('combine'):
    y_RD = collect(out_XD, src_X, slots)
  return y_RD, dropped.astype(jnp.int32)


def all_to_all(buf_nSD, n: int):
  """The padded exchange of [n, slot, ...] over `expert` (slot j to device j); with one
  expert device the buffer itself (no collective: a compiler may refuse one over groups of
  one, as libtpu's async ragged all-to-all does)."""
  return buf_nSD if n == 1 else jax.lax.all_to_all(buf_nSD, 'expert', 0, 0, tiled=True)


def exchange(x_TD, experts_Tk, weights_Tk, keep_Tk, params, body, name_exchange: bool = True):
  """A device's MoE by token rows (module docstring) with `body`'s settings (an
  expert_parallel.Body: devices, transport, bounds, chunks, runtime): pairs, the exchange
  there (rows and routing, named 'exchange' for the remat policies unless `name_exchange` is
  off), the experts, the exchange back, the sum per token. Returns (y_TD float32, the
  assignments dropped past a slot or the expansion)."""
  t, k = experts_Tk.shape
  named = (lambda v: checkpoint_name(v, 'exchange')) if name_exchange else (lambda v: v)
  d, e_loc, n = x_TD.shape[1], params['gate'].shape[0], body.n
  me, slot = jax.lax.axis_index('expert'), body.token_slot(t, k)
  p = pairs(x_TD, experts_Tk, weights_Tk, keep_Tk, n, e_loc, slot, body.max_devices)
  with jax.named_scope('permute'):
    raw_nn = jax.lax.all_gather(p.counts_n, 'expert')        # [src, dest] pairs
  kept_nn = jnp.minimum(raw_nn, slot)
  c_in = kept_nn[:, me]
  with jax.named_scope('exchange'):
    if body.kind == 'padded':
      put = lambda v: all_to_all(
          jnp.zeros((n, slot, v.shape[1]), v.dtype).at[p.dest_M, p.rank_M].set(v, mode='drop'),
          n).reshape(n * slot, v.shape[1])
      valid_R = (jnp.arange(slot) < c_in[:, None]).reshape(-1)
    else:
      send_off, out_off = exclusive_cumsum(p.counts_n), exclusive_cumsum(kept_nn, 0)[me]
      put = lambda v: jax.lax.ragged_all_to_all(
          v, jnp.zeros((n * slot, v.shape[1]), v.dtype), send_off, kept_nn[me], out_off, c_in,
          axis_name='expert')
      valid_R = jnp.arange(n * slot) < jnp.sum(c_in)
    x_RD, meta_Rk2 = named(put(p.x_MD)), named(put(p.meta_Mk2))
  y_RD, dropped_x = expand_and_combine(x_RD, meta_Rk2, valid_R, params, body.expand_rows(t, k),
                                       body.runtime, body.block_rows)
  y_RD = y_RD.astype(x_TD.dtype)
  with jax.named_scope('exchange_back'):
    if body.kind == 'padded':
      back = all_to_all(y_RD.reshape(n, slot, d), n)
      back_MD = back.at[p.dest_M, p.rank_M].get(mode='fill', fill_value=0)
    else:
      src_off = exclusive_cumsum(raw_nn, 1)[:, me]
      back_MD = jax.lax.ragged_all_to_all(
          y_RD, jnp.zeros((p.x_MD.shape[0], d), y_RD.dtype), exclusive_cumsum(c_in), c_in,
          src_off, kept_nn[me], axis_name='expert')
    back_MD = named(back_MD)
  with jax.named_scope('combine'):
    y_TD = collect(back_MD, p.src_M, p.slots_Tc)
  if body.tensor > 1:
    y_TD = jax.lax.psum(y_TD, 'tensor')
  return y_TD, p.dropped + dropped_x
