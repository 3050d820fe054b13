"""Dropless MoE dispatch behind one small interface.

    dispatch(x_TD, experts_Tk, weights_Tk, params, backend) -> y_TD

`params` holds the SwiGLU experts: gate_EDF, up_EDF, down_EFD. Backends:

- `reference`: slow and obvious. Every expert runs on every token; a token keeps the outputs
  of the experts it chose, weighted. Cost grows with E.
- `sorted`: permute the T*k assignments into expert order (stable sort), run a grouped
  matmul over the ragged groups with `gmm_tiled`, un-permute, combine. The work is
  about (T*k/tile + E) tiles of `tile` rows, so it stays flat in E at fixed T*k.
- `xla`: the same stages with `jax.lax.ragged_dot` as the grouped matmul (the right choice
  on GPU/TPU; on CPU it computes masked dense work that grows with E).

No capacity limit: no token is ever dropped.
"""
from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp


def _swiglu(gate, up):
  return jax.nn.silu(gate) * up


# Tiled grouped matmul -----------------------------------------------------------------------

def _work_items(group_sizes_G, num_rows: int, tile: int):
  """Lists the (tile, group) pairs whose intersection is non-empty.

  Rows are in group order; group g owns rows [start_g, end_g). Returns per work item its
  group, its tile index, and whether it is real (the static item count is an upper bound).
  """
  num_groups = group_sizes_G.shape[0]
  num_tiles = -(-num_rows // tile)
  max_items = num_tiles + num_groups - 1
  sizes = group_sizes_G.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  first = starts // tile
  last = jnp.maximum(ends - 1, 0) // tile
  count = jnp.where(sizes > 0, last - first + 1, 0)
  item_end = jnp.cumsum(count)
  item = jnp.arange(max_items, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(item_end, item, side='right'), num_groups - 1)
  item_start = item_end - count
  tile_idx = first[group] + item - item_start[group]
  valid = item < item_end[-1]
  tile_idx = jnp.where(valid, tile_idx, 0)
  return group.astype(jnp.int32), tile_idx.astype(jnp.int32), valid, starts, ends


def _row_mask(tile_idx, group, valid, starts, ends, tile):
  rows = tile_idx * tile + jnp.arange(tile)
  return (rows >= starts[group]) & (rows < ends[group]) & valid


def _pad_rows(x, tile):
  pad = -x.shape[0] % tile
  return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _gmm_fwd_impl(lhs_MK, rhs_GKN, group_sizes_G, tile, transpose_rhs=False):
  """lhs @ rhs[g] per group; with `transpose_rhs`, lhs @ rhs[g].T (no transposed copy)."""
  m = lhs_MK.shape[0]
  n = rhs_GKN.shape[1 if transpose_rhs else 2]
  if m == 0:
    return jnp.zeros((0, n), lhs_MK.dtype)
  group, tile_idx, valid, starts, ends = _work_items(group_sizes_G, m, tile)
  lhs = _pad_rows(lhs_MK, tile)
  out = jnp.zeros((lhs.shape[0], n), jnp.float32)
  contract = (((1,), (1 if transpose_rhs else 0,)), ((), ()))

  def body(i, out):
    g, t = group[i], tile_idx[i]
    mask = _row_mask(t, g, valid[i], starts, ends, tile)
    rows = jax.lax.dynamic_slice_in_dim(lhs, t * tile, tile)
    prod = jax.lax.dot_general(rows, rhs_GKN[g], contract, preferred_element_type=jnp.float32)
    old = jax.lax.dynamic_slice_in_dim(out, t * tile, tile)
    return jax.lax.dynamic_update_slice_in_dim(out, old + jnp.where(mask[:, None], prod, 0),
                                               t * tile, 0)

  out = jax.lax.fori_loop(0, group.shape[0], body, out)
  return out[:m].astype(lhs_MK.dtype)


def _tgmm_impl(lhs_MK, grad_MN, group_sizes_G, num_groups, tile):
  """Per-group lhs^T @ grad: the weight gradient of the grouped matmul, [G, K, N]."""
  m = lhs_MK.shape[0]
  if m == 0:
    return jnp.zeros((num_groups, lhs_MK.shape[1], grad_MN.shape[1]), jnp.float32)
  group, tile_idx, valid, starts, ends = _work_items(group_sizes_G, m, tile)
  lhs, grad = _pad_rows(lhs_MK, tile), _pad_rows(grad_MN, tile)
  acc = jnp.zeros((num_groups, lhs.shape[1], grad.shape[1]), jnp.float32)

  def body(i, acc):
    g, t = group[i], tile_idx[i]
    mask = _row_mask(t, g, valid[i], starts, ends, tile)
    rows = jnp.where(mask[:, None], jax.lax.dynamic_slice_in_dim(lhs, t * tile, tile), 0)
    gr = jax.lax.dynamic_slice_in_dim(grad, t * tile, tile)
    upd = jnp.dot(rows.T, gr, preferred_element_type=jnp.float32)
    return acc.at[g].add(upd)

  return jax.lax.fori_loop(0, group.shape[0], body, acc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gmm_tiled(lhs_MK, rhs_GKN, group_sizes_G, tile=64):
  """Grouped matmul with `jax.lax.ragged_dot` semantics, tiled so no dense masking is done.

  lhs [M, K] rows sorted by group; rhs [G, K, N]; group_sizes [G] summing to at most M;
  rows past the sum give zeros. Accumulates in float32.
  """
  return _gmm_fwd_impl(lhs_MK, rhs_GKN, group_sizes_G, tile)


def _gmm_vjp_fwd(lhs, rhs, group_sizes, tile):
  return _gmm_fwd_impl(lhs, rhs, group_sizes, tile), (lhs, rhs, group_sizes)


def _gmm_vjp_bwd(tile, res, g_MN):
  lhs, rhs, group_sizes = res
  d_lhs = _gmm_fwd_impl(g_MN, rhs, group_sizes, tile, transpose_rhs=True).astype(lhs.dtype)
  d_rhs = _tgmm_impl(lhs, g_MN, group_sizes, rhs.shape[0], tile).astype(rhs.dtype)
  return d_lhs, d_rhs, None


gmm_tiled.defvjp(_gmm_vjp_fwd, _gmm_vjp_bwd)


def gmm_xla(lhs_MK, rhs_GKN, group_sizes_G, tile=None):
  del tile
  return jax.lax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32),
                            preferred_element_type=jnp.float32).astype(lhs_MK.dtype)


# Dispatch backends ----------------------------------------------------------------------------

def dispatch_reference(x_TD, experts_Tk, weights_Tk, params, tile=None):
  """Runs every expert on every token and keeps each token's chosen outputs."""
  del tile
  num_experts = params['gate'].shape[0]
  y_TD = jnp.zeros(x_TD.shape, jnp.float32)
  for e in range(num_experts):
    h = _swiglu(x_TD @ params['gate'][e], x_TD @ params['up'][e])
    out_TD = (h @ params['down'][e]).astype(jnp.float32)
    w_T = jnp.sum(jnp.where(experts_Tk == e, weights_Tk, 0.0), axis=-1)
    y_TD = y_TD + w_T[:, None] * out_TD
  return y_TD.astype(x_TD.dtype)


def _grouped(gmm):
  def run(x_TD, experts_Tk, weights_Tk, params, tile=64):
    num_tokens, k = experts_Tk.shape
    num_experts = params['gate'].shape[0]
    with jax.named_scope('permute'):
      flat_expert = experts_Tk.reshape(-1)
      order = jnp.argsort(flat_expert, stable=True)
      token_of = order // k
      x_MD = x_TD[token_of]
      group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    with jax.named_scope('grouped_matmul'):
      gate = gmm(x_MD, params['gate'], group_sizes, tile)
      up = gmm(x_MD, params['up'], group_sizes, tile)
      out_MD = gmm(_swiglu(gate, up), params['down'], group_sizes, tile)
    with jax.named_scope('unpermute'):
      inverse = jnp.argsort(order)
      out_TkD = out_MD[inverse].reshape(num_tokens, k, -1)
    with jax.named_scope('combine'):
      y = jnp.einsum('tkd,tk->td', out_TkD.astype(jnp.float32), weights_Tk.astype(jnp.float32))
    return y.astype(x_TD.dtype)
  return run


BACKENDS = {
    'reference': dispatch_reference,
    'sorted': _grouped(gmm_tiled),
    'xla': _grouped(gmm_xla),
}


def dispatch(x_TD, experts_Tk, weights_Tk, params: Mapping[str, jax.Array],
             backend: str = 'sorted', tile: int = 64):
  """Applies the chosen experts of every token and combines them with their weights."""
  if backend not in BACKENDS:
    raise ValueError(f'model.dispatch={backend!r}: must be one of {sorted(BACKENDS)}')
  return BACKENDS[backend](x_TD, experts_Tk, weights_Tk, params, tile=tile)
