"""Grouped matmul kernels for TPU (Pallas Mosaic), run on CPU under pltpu.InterpretParams().

The work-item metadata (metadata.resident_items) is scalar-prefetched into SMEM. `gmm`: grid
(N tiles, work items, K tiles), the contraction innermost; `tgmm`: grid (K tiles, N tiles, work
items), K an axis of its [G, K, N] output. Consecutive steps that share an output block keep it
resident and accumulate in a float32 VMEM scratch (zeroed at the block's first (item, k=0),
stored at its last), so each block is written once. Row masks cut the ragged group edges inside
a tile (tgmm masks both operands, so a non-finite row of another group cannot enter as
0 x inf). K tiling bounds VMEM whatever K: per step gmm holds lhs (tile_m, tile_k), rhs
(tile_k, tile_n), tgmm lhs (tile_m, tile_k), grad (tile_m, tile_n), out (tile_k, tile_n).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import metadata

_META = ('group', 'tile', 'valid', 'tile_first', 'tile_last', 'group_first', 'group_last',
         'starts', 'ends')


def _row_mask(tile_m, row0, group, starts_ref, ends_ref):
  rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (tile_m, 1), 0)
  return (rows >= starts_ref[group]) & (rows < ends_ref[group])


def _tile_k(k: int, tile_k: int | None) -> int:
  """tile_k when it divides K, else K (one block spans the contraction)."""
  return tile_k if tile_k and k % tile_k == 0 else k


def _gmm_kernel(*refs, tile_m, transpose_rhs):
  (group_ref, tile_ref, valid_ref, first_ref, last_ref, _, _, starts_ref, ends_ref,
   lhs_ref, rhs_ref, out_ref, acc_ref) = refs
  i, kk = pl.program_id(1), pl.program_id(2)

  @pl.when((first_ref[i] == 1) & (kk == 0))
  def _zero():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(valid_ref[i] == 1)
  def _accumulate():
    contract = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
    prod = jax.lax.dot_general(lhs_ref[...], rhs_ref[...], contract,
                               preferred_element_type=jnp.float32)
    mask = _row_mask(tile_m, tile_ref[i] * tile_m, group_ref[i], starts_ref, ends_ref)
    acc_ref[...] += jnp.where(mask, prod, 0.0)

  @pl.when((last_ref[i] == 1) & (kk == pl.num_programs(2) - 1))
  def _store():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, tile_m: int = 128, tile_n: int = 128,
        tile_k: int | None = 512, transpose_rhs: bool = False, out_dtype=None,
        interpret=False):
  """lhs @ rhs[g] per group (rhs[g].T with `transpose_rhs`, rhs then [G, N, K]).

  M must be a multiple of tile_m and N of tile_n (ops.py pads); K is tiled by tile_k when it
  divides K (else one block spans K). Rows of tiles that no group touches are left unwritten
  (ops.py masks rows past the group-size sum)."""
  m, k = lhs_MK.shape
  n = rhs_GKN.shape[1 if transpose_rhs else 2]
  tile_k = _tile_k(k, tile_k)
  meta = metadata.resident_items(group_sizes_G, m, tile_m)
  meta = [meta[key] for key in _META]
  num_items = meta[0].shape[0]
  rhs_block = (None, tile_n, tile_k) if transpose_rhs else (None, tile_k, tile_n)
  rhs_index = ((lambda j, i, kk, g, *_: (g[i], j, kk)) if transpose_rhs
               else (lambda j, i, kk, g, *_: (g[i], kk, j)))
  spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(meta),
      grid=(n // tile_n, num_items, k // tile_k),
      in_specs=[pl.BlockSpec((tile_m, tile_k), lambda j, i, kk, g, t, *_: (t[i], kk)),
                pl.BlockSpec(rhs_block, rhs_index)],
      out_specs=pl.BlockSpec((tile_m, tile_n), lambda j, i, kk, g, t, *_: (t[i], j)),
      scratch_shapes=[pltpu.VMEM((tile_m, tile_n), jnp.float32)])
  kernel = functools.partial(_gmm_kernel, tile_m=tile_m, transpose_rhs=transpose_rhs)
  return pl.pallas_call(
      kernel, grid_spec=spec,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype or lhs_MK.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'arbitrary', 'arbitrary')),
      interpret=interpret)(*meta, lhs_MK, rhs_GKN)


def _tgmm_kernel(*refs, tile_m):
  (group_ref, tile_ref, valid_ref, _, _, first_ref, last_ref, starts_ref, ends_ref,
   lhs_ref, grad_ref, out_ref, acc_ref) = refs
  i = pl.program_id(2)

  @pl.when(first_ref[i] == 1)
  def _zero():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(valid_ref[i] == 1)
  def _accumulate():
    mask = _row_mask(tile_m, tile_ref[i] * tile_m, group_ref[i], starts_ref, ends_ref)
    # both operands: 0 x inf would let another group's non-finite rows into this sum
    lhs = jnp.where(mask, lhs_ref[...], 0).astype(lhs_ref.dtype)
    grad = jnp.where(mask, grad_ref[...], 0).astype(grad_ref.dtype)
    acc_ref[...] += jax.lax.dot_general(lhs, grad, (((0,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32)

  @pl.when(last_ref[i] == 1)
  def _store():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def tgmm(lhs_MK, grad_MN, group_sizes_G, *, tile_m: int = 128, tile_n: int = 128,
         tile_k: int | None = 512, out_dtype=jnp.float32, interpret=False):
  """Per-group lhs^T @ grad -> [G, K, N], in (tile_k, tile_n) output blocks (tile_k when it
  divides K, else K); blocks of empty groups are left unwritten (ops.py zeroes them)."""
  m, k = lhs_MK.shape
  n = grad_MN.shape[1]
  tile_k = _tile_k(k, tile_k)
  num_groups = group_sizes_G.shape[0]
  meta = metadata.resident_items(group_sizes_G, m, tile_m)
  meta = [meta[key] for key in _META]
  spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(meta),
      grid=(k // tile_k, n // tile_n, meta[0].shape[0]),
      in_specs=[pl.BlockSpec((tile_m, tile_k), lambda kk, j, i, g, t, *_: (t[i], kk)),
                pl.BlockSpec((tile_m, tile_n), lambda kk, j, i, g, t, *_: (t[i], j))],
      out_specs=pl.BlockSpec((None, tile_k, tile_n), lambda kk, j, i, g, *_: (g[i], kk, j)),
      scratch_shapes=[pltpu.VMEM((tile_k, tile_n), jnp.float32)])
  return pl.pallas_call(
      functools.partial(_tgmm_kernel, tile_m=tile_m), grid_spec=spec,
      out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'arbitrary')),
      interpret=interpret)(*meta, lhs_MK, grad_MN)
