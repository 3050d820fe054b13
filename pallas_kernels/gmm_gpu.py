"""Grouped matmul kernels in the GPU (Triton-style) Pallas model; on CPU with interpret=True.

`gmm`: one program per (row tile, N tile); it loops over the groups that own rows of its tile
(metadata.tile_group_range, usually one or two) and masks rows at group edges, accumulating in
float32 registers. `tgmm`: one program per (group, K tile, N tile); it loops over the row tiles
of its group. No atomics: every output block has exactly one writer, and programs of empty
groups or tiles past the group-size sum write zeros.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import metadata


def _gmm_kernel(lo_ref, hi_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref, *, tile_m,
                transpose_rhs):
  m = pl.program_id(0)
  rows = m * tile_m + jax.lax.broadcasted_iota(jnp.int32, (tile_m, 1), 0)
  lhs = lhs_ref[...]
  contract = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))

  def body(g, acc):
    prod = jax.lax.dot_general(lhs, rhs_ref[g], contract, preferred_element_type=jnp.float32)
    mask = (rows >= starts_ref[g]) & (rows < ends_ref[g])
    return acc + jnp.where(mask, prod, 0.0)

  acc = jnp.zeros(out_ref.shape, jnp.float32)
  acc = jax.lax.fori_loop(lo_ref[m], hi_ref[m] + 1, body, acc)
  out_ref[...] = acc.astype(out_ref.dtype)


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, tile_m: int = 64, tile_n: int = 64,
        transpose_rhs: bool = False, out_dtype=None, interpret=False):
  """lhs @ rhs[g] per group (rhs[g].T with `transpose_rhs`, rhs then [G, N, K]); M a multiple
  of tile_m, N of tile_n (ops.py pads). Rows past the group-size sum come out zero."""
  m, k = lhs_MK.shape
  num_groups = rhs_GKN.shape[0]
  n = rhs_GKN.shape[1 if transpose_rhs else 2]
  lo, hi = metadata.tile_group_range(group_sizes_G, m, tile_m)
  starts, ends = metadata.group_bounds(group_sizes_G)
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)
  rhs_spec = (pl.BlockSpec((num_groups, tile_n, k), lambda i, j: (0, j, 0)) if transpose_rhs
              else pl.BlockSpec((num_groups, k, tile_n), lambda i, j: (0, 0, j)))
  return pl.pallas_call(
      functools.partial(_gmm_kernel, tile_m=tile_m, transpose_rhs=transpose_rhs),
      grid=(m // tile_m, n // tile_n),
      in_specs=[whole(lo), whole(hi), whole(starts), whole(ends),
                pl.BlockSpec((tile_m, k), lambda i, j: (i, 0)), rhs_spec],
      out_specs=pl.BlockSpec((tile_m, tile_n), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype or lhs_MK.dtype),
      interpret=interpret)(lo, hi, starts, ends, lhs_MK, rhs_GKN)


def _tgmm_kernel(starts_ref, ends_ref, lhs_ref, grad_ref, out_ref, *, tile_m):
  g = pl.program_id(0)
  start, end = starts_ref[g], ends_ref[g]

  def body(t, acc):
    row0 = pl.multiple_of(t * tile_m, tile_m)
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (tile_m, 1), 0)
    mask = (rows >= start) & (rows < end)
    lhs = jnp.where(mask, lhs_ref[pl.ds(row0, tile_m), :], 0).astype(lhs_ref.dtype)
    grad = grad_ref[pl.ds(row0, tile_m), :]
    return acc + jax.lax.dot_general(lhs, grad, (((0,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

  first, last = start // tile_m, (end + tile_m - 1) // tile_m
  acc = jax.lax.fori_loop(first, last, body, jnp.zeros(out_ref.shape, jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


def tgmm(lhs_MK, grad_MN, group_sizes_G, *, tile_m: int = 64, tile_n: int = 64,
         tile_k: int | None = None, out_dtype=jnp.float32, interpret=False):
  """Per-group lhs^T @ grad -> [G, K, N]; empty groups give zeros. M a multiple of tile_m."""
  m, k = lhs_MK.shape
  n = grad_MN.shape[1]
  tile_k = tile_k or k
  num_groups = group_sizes_G.shape[0]
  starts, ends = metadata.group_bounds(group_sizes_G)
  whole = lambda a: pl.BlockSpec(a.shape, lambda g, a_, b_: (0,) * a.ndim)
  return pl.pallas_call(
      functools.partial(_tgmm_kernel, tile_m=tile_m),
      grid=(num_groups, k // tile_k, n // tile_n),
      in_specs=[whole(starts), whole(ends),
                pl.BlockSpec((m, tile_k), lambda g, a, b: (0, a)),
                pl.BlockSpec((m, tile_n), lambda g, a, b: (0, b))],
      out_specs=pl.BlockSpec((None, tile_k, tile_n), lambda g, a, b: (g, a, b)),
      out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
      interpret=interpret)(starts, ends, lhs_MK, grad_MN)
