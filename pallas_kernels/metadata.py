"""Group/tile work items of a grouped matmul, shared by every target (pure JAX, jit-friendly).

Rows of lhs [M, K] are sorted by group: group g owns rows [start_g, end_g). A row tile of
`tile` rows meets one or more groups; a *work item* is one (tile, group) pair whose
intersection is non-empty. There are at most num_tiles + G - 1 of them, a static bound, so the
work stays ~ M / tile + G tiles whatever the group sizes (no dense masking over all G).
"""
from __future__ import annotations

import jax.numpy as jnp


def fit_tile(tile: int, dim: int) -> int:
  """The tile if it divides dim, else dim itself (one block spans it)."""
  return tile if dim % tile == 0 else dim


def next_pow2(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1): Triton block shapes."""
  return 1 << max(n - 1, 0).bit_length()


def group_bounds(group_sizes_G):
  """(starts_G, ends_G) int32 row bounds of every group."""
  sizes = group_sizes_G.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  return ends - sizes, ends


def work_items(group_sizes_G, num_rows: int, tile: int):
  """Lists the (tile, group) pairs whose intersection is non-empty.

  Returns per work item its group, its tile index and whether it is real (the static item
  count num_tiles + G - 1 is an upper bound; padding items point at tile 0, group of the
  last real item), plus starts_G and ends_G.
  """
  num_groups = group_sizes_G.shape[0]
  num_tiles = -(-num_rows // tile)
  max_items = num_tiles + num_groups - 1
  sizes = group_sizes_G.astype(jnp.int32)
  starts, ends = group_bounds(sizes)
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


def resident_items(group_sizes_G, num_rows: int, tile: int):
  """Work items for kernels whose output block stays resident while its index repeats (TPU).

  Padding items repeat the last real item's (tile, group), so no block is revisited after it
  was left. Returns int32 arrays: group_I, tile_I, valid_I, tile_first_I / tile_last_I (first
  and last real item of its row tile), group_first_I / group_last_I (same for its group),
  plus starts_G, ends_G.
  """
  group, tile_idx, valid, starts, ends = work_items(group_sizes_G, num_rows, tile)
  num_valid = jnp.sum(valid.astype(jnp.int32))
  last_real = jnp.maximum(num_valid - 1, 0)
  group = jnp.where(valid, group, group[last_real])
  tile_idx = jnp.where(valid, tile_idx, tile_idx[last_real])

  def edges(key):
    prev_differs = jnp.concatenate([jnp.ones((1,), bool), key[1:] != key[:-1]])
    next_differs = jnp.concatenate([key[1:] != key[:-1], jnp.ones((1,), bool)])
    is_last_real = jnp.arange(key.shape[0]) == num_valid - 1
    return prev_differs & valid, (next_differs | is_last_real) & valid

  tile_first, tile_last = edges(tile_idx)
  group_first, group_last = edges(group)
  i32 = lambda a: a.astype(jnp.int32)
  return dict(group=i32(group), tile=i32(tile_idx), valid=i32(valid),
              tile_first=i32(tile_first), tile_last=i32(tile_last),
              group_first=i32(group_first), group_last=i32(group_last),
              starts=starts, ends=ends)


def tile_group_range(group_sizes_G, num_rows: int, tile: int):
  """Per row tile, the first and last group that may own one of its rows ([num_tiles] int32).

  Tiles past the last real row get an empty range (lo > hi)."""
  starts, ends = group_bounds(group_sizes_G)
  num_tiles = -(-num_rows // tile)
  row0 = jnp.arange(num_tiles, dtype=jnp.int32) * tile
  row1 = jnp.minimum(row0 + tile, ends[-1]) - 1
  lo = jnp.searchsorted(ends, row0, side='right').astype(jnp.int32)
  hi = jnp.searchsorted(ends, row1, side='right').astype(jnp.int32)
  hi = jnp.where(row1 >= row0, jnp.minimum(hi, group_sizes_G.shape[0] - 1), lo - 1)
  return lo, hi.astype(jnp.int32)
