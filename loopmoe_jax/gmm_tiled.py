"""The tiled grouped matmul in plain JAX: `gmm_tiled(lhs_MK, rhs_GKN, group_sizes_G, tile)`
computes out[m] = lhs[m] @ rhs[g(m)] for rows sorted into G ragged groups, as whole tiles of
`tile` rows plus one remainder chunk per group (dispatch.py's 'tiled' backend, the CPU
choice), with a custom VJP whose weight gradient is the transposed grouped matmul. Tiles are
written in the output dtype (no float32 buffer of every row).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.metadata import group_bounds


def _pad_rows(x, tile):
  pad = -x.shape[0] % tile
  return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def accumulation_dtype(*operands):
  """The accumulation dtype of a grouped matmul: float32, or the operands' promoted dtype
  when wider (float64 operands under jax_enable_x64 are computed in float64)."""
  return jnp.promote_types(jnp.result_type(*operands), jnp.float32)


# Smallest remainder chunk. Measured here (16384 rows, K 256, N 512, E 64): separate loops
# for chunks 64, 32, 16, 8 cost more than the rows they save, so remainders take 1-2 sizes.
MIN_CHUNK = 64


def _chunk_sizes(tile: int):
  """Row-chunk sizes of the remainder pass: tile, tile/2, ... down to 8 (or just tile)."""
  sizes = [tile]
  while sizes[-1] // 2 >= MIN_CHUNK:
    sizes.append(sizes[-1] // 2)
  return sizes


def fit_tile(rows: int, tile: int) -> int:
  """`tile`, or where every row fits in one tile the smallest power of two >= rows (at least
  8): a decode step's few routed rows are not each computed as part of a whole tile."""
  if rows >= tile:
    return tile
  return max(8, 1 << max(rows - 1, 0).bit_length())


def _tile_plan(sizes_G, rows_p: int, tile: int):
  """The work of both passes, shared by the grouped matmul and its weight gradient.

  Returns (whole, remainders): whole = (group [W], row0 [W], count) of the whole tiles (the
  first `count` are real); remainders = [(chunk, groups [G], count)] per chunk size, the
  groups whose last size_g mod tile rows fit that chunk size (the first `count` are real)."""
  num_groups = sizes_G.shape[0]
  starts, _ = group_bounds(sizes_G)
  whole = sizes_G // tile
  whole_end = jnp.cumsum(whole)
  item = jnp.arange(rows_p // tile, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(whole_end, item, side='right'), num_groups - 1)
  row0 = starts[group] + (item - (whole_end - whole)[group]) * tile
  rem = sizes_G % tile
  chunks = _chunk_sizes(tile)
  remainders = []
  for c, smaller in zip(chunks, chunks[1:] + [0]):
    in_class = (rem > smaller) & (rem <= c)
    (groups,) = jnp.nonzero(in_class, size=num_groups, fill_value=0)
    remainders.append((c, groups, jnp.sum(in_class.astype(jnp.int32))))
  return (group, row0, whole_end[-1]), remainders


def _gmm_fwd_impl(lhs_MK, rhs_GKN, group_sizes_G, tile, transpose_rhs=False):
  """lhs @ rhs[g] per group; with `transpose_rhs`, lhs @ rhs[g].T (no transposed copy).

  Two passes, neither masks dense work:
  - whole tiles: every run of `tile` rows inside one group, written once (no read, no mask);
    at most M / tile of them.
  - remainders: the last size_g mod tile rows of each group, as one chunk of the smallest size
    in _chunk_sizes that holds them, ending at the group's end; rows of other groups in the
    chunk keep their value (a masked read-modify-write of <= tile rows, <= G chunks).
  Every row of a group is computed from its own rows only, so the order does not matter.
  """
  m = lhs_MK.shape[0]
  n = rhs_GKN.shape[1 if transpose_rhs else 2]
  if m == 0:
    return jnp.zeros((0, n), lhs_MK.dtype)
  if m < tile:
    return _gmm_one_tile(lhs_MK, rhs_GKN, group_sizes_G, fit_tile(m, tile), transpose_rhs)
  lhs = _pad_rows(lhs_MK, tile)
  rows_p = lhs.shape[0]
  sizes = group_sizes_G.astype(jnp.int32)
  starts, ends = group_bounds(sizes)
  acc_dtype = accumulation_dtype(lhs_MK, rhs_GKN)
  contract = (((1,), (1 if transpose_rhs else 0,)), ((), ()))
  # Each row's sum is finished inside one tile's matmul (the whole K), so a tile is written
  # in the output dtype at once: no float32 buffer of every row (with bfloat16 operands it
  # halved the expert-parallel train step's largest temporaries; the values are the same).
  matmul = lambda rows, g: jax.lax.dot_general(rows, rhs_GKN[g], contract,
                                               preferred_element_type=acc_dtype
                                               ).astype(lhs_MK.dtype)
  out = jnp.zeros((rows_p, n), lhs_MK.dtype)
  (group, row0, num_whole), remainders = _tile_plan(sizes, rows_p, tile)

  with jax.named_scope('whole_tiles'):
    def whole_tile(i, out):
      rows = jax.lax.dynamic_slice_in_dim(lhs, row0[i], tile)
      return jax.lax.dynamic_update_slice_in_dim(out, matmul(rows, group[i]), row0[i], 0)

    out = jax.lax.fori_loop(0, num_whole, whole_tile, out)

  with jax.named_scope('remainders'):
    for c, groups, count in remainders:
      def remainder(j, out, c=c, groups=groups):
        g = groups[j]
        first = jnp.clip(ends[g] - c, 0, rows_p - c)
        rows = first + jnp.arange(c)
        mine = ((rows >= starts[g]) & (rows < ends[g]))[:, None]
        prod = matmul(jax.lax.dynamic_slice_in_dim(lhs, first, c), g)
        old = jax.lax.dynamic_slice_in_dim(out, first, c)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, prod, old), first, 0)

      out = jax.lax.fori_loop(0, count, remainder, out)
  return out[:m]


def _gmm_one_tile(lhs_MK, rhs_GKN, group_sizes_G, chunk: int, transpose_rhs: bool):
  """_gmm_fwd_impl when every row fits one tile (a decode step's few rows): the groups with
  rows, at most P = min(G, M) of them, each as one chunk of `chunk` rows starting at its
  first row, computed in one batched matmul [P, chunk, K] x [P, K, N] and written back by row
  (each row by its own group's chunk only). The same chunks as the loop, in a fixed number of
  operations instead of a few per group."""
  m, num_groups = lhs_MK.shape[0], group_sizes_G.shape[0]
  p = min(num_groups, m)
  sizes = group_sizes_G.astype(jnp.int32)
  starts, ends = group_bounds(sizes)
  (gid_P,) = jnp.nonzero(sizes > 0, size=p, fill_value=0)
  used_P = jnp.arange(p) < jnp.sum((sizes > 0).astype(jnp.int32))
  rows_PC = starts[gid_P][:, None] + jnp.arange(chunk)
  mine_PC = (rows_PC < ends[gid_P][:, None]) & used_P[:, None]
  lhs = _pad_rows(lhs_MK, chunk)
  x_PCK = lhs[jnp.minimum(rows_PC, lhs.shape[0] - 1)]
  spec = 'pck,pnk->pcn' if transpose_rhs else 'pck,pkn->pcn'
  y_PCN = jnp.einsum(spec, x_PCK, rhs_GKN[gid_P],
                     preferred_element_type=accumulation_dtype(lhs_MK, rhs_GKN))
  y_PCN = y_PCN.astype(lhs_MK.dtype)
  target_PC = jnp.where(mine_PC, rows_PC, m)  # rows not the chunk's own go past the end
  out = jnp.zeros((m + 1, y_PCN.shape[-1]), lhs_MK.dtype)
  return out.at[target_PC.reshape(-1)].set(y_PCN.reshape(-1, y_PCN.shape[-1]))[:m]


def _tgmm_impl(lhs_MK, grad_MN, group_sizes_G, num_groups, tile):
  """Per-group lhs^T @ grad: the weight gradient of the grouped matmul, [G, K, N].

  The same two passes as _gmm_fwd_impl: whole tiles inside one group, then per group one
  chunk ending at its end whose rows outside the group's last size_g mod tile rows are zeroed
  in both operands (so no row is counted twice, and no other group's non-finite row enters
  the sum as 0 x inf)."""
  m = lhs_MK.shape[0]
  acc_dtype = accumulation_dtype(lhs_MK, grad_MN)
  if m == 0:
    return jnp.zeros((num_groups, lhs_MK.shape[1], grad_MN.shape[1]), acc_dtype)
  tile = fit_tile(m, tile)
  lhs, grad = _pad_rows(lhs_MK, tile), _pad_rows(grad_MN, tile)
  rows_p = lhs.shape[0]
  sizes = group_sizes_G.astype(jnp.int32)
  _, ends = group_bounds(sizes)
  acc = jnp.zeros((num_groups, lhs.shape[1], grad.shape[1]), acc_dtype)
  outer = lambda a, b: jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                                           preferred_element_type=acc_dtype)

  (group, row0, num_whole), remainders = _tile_plan(sizes, rows_p, tile)
  rem = sizes % tile

  with jax.named_scope('whole_tiles'):
    def whole_tile(i, acc):
      rows = jax.lax.dynamic_slice_in_dim(lhs, row0[i], tile)
      gr = jax.lax.dynamic_slice_in_dim(grad, row0[i], tile)
      return acc.at[group[i]].add(outer(rows, gr))

    acc = jax.lax.fori_loop(0, num_whole, whole_tile, acc)

  with jax.named_scope('remainders'):
    for c, groups, count in remainders:
      def remainder(j, acc, c=c, groups=groups):
        g = groups[j]
        first = jnp.clip(ends[g] - c, 0, rows_p - c)
        rows = first + jnp.arange(c)
        mine = ((rows >= ends[g] - rem[g]) & (rows < ends[g]))[:, None]
        lhs_c = jax.lax.dynamic_slice_in_dim(lhs, first, c)
        lhs_c = jnp.where(mine, lhs_c, 0).astype(lhs.dtype)
        grad_c = jax.lax.dynamic_slice_in_dim(grad, first, c)
        grad_c = jnp.where(mine, grad_c, 0).astype(grad.dtype)
        return acc.at[g].add(outer(lhs_c, grad_c))

      acc = jax.lax.fori_loop(0, count, remainder, acc)
  return acc


def gmm_tiled(lhs_MK, rhs_GKN, group_sizes_G, tile=128):
  """Grouped matmul with `jax.lax.ragged_dot` semantics, tiled so no dense masking is done.

  lhs [M, K] rows sorted by group; rhs [G, K, N]; group_sizes [G] summing to at most M;
  rows past the sum give zeros. Operands may be numpy arrays. Accumulates in float32, or in
  float64 for float64 operands (jax_enable_x64).
  """
  return _gmm_tiled(jnp.asarray(lhs_MK), jnp.asarray(rhs_GKN), jnp.asarray(group_sizes_G),
                    tile)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_tiled(lhs_MK, rhs_GKN, group_sizes_G, tile):
  return _gmm_fwd_impl(lhs_MK, rhs_GKN, group_sizes_G, tile)


def _gmm_vjp_fwd(lhs, rhs, group_sizes, tile):
  return _gmm_fwd_impl(lhs, rhs, group_sizes, tile), (lhs, rhs, group_sizes)


def _gmm_vjp_bwd(tile, res, g_MN):
  lhs, rhs, group_sizes = res
  d_lhs = _gmm_fwd_impl(g_MN, rhs, group_sizes, tile, transpose_rhs=True).astype(lhs.dtype)
  d_rhs = _tgmm_impl(lhs, g_MN, group_sizes, rhs.shape[0], tile).astype(rhs.dtype)
  return d_lhs, d_rhs, None


_gmm_tiled.defvjp(_gmm_vjp_fwd, _gmm_vjp_bwd)
