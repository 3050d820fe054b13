"""Grouped matmul kernels for GPU (Pallas Triton backend); on CPU with interpret=True.

`gmm`: one program per (N tile, row tile); grid axis 0 (the fastest-launched) walks the N
tiles, so the programs in flight share their lhs row tiles and the current group's weights in
L2. A program loops over the groups that own rows of its tile (metadata.tile_group_range,
usually one; two or more only at group edges), and per group over K in `tile_k` steps (plain
load + dot, which Triton software-pipelines), masking the rows of other groups once per group
on the float32 accumulator. `tgmm`: one program per (N tile, K tile, group); it loops over the
row tiles of its group, masking rows of neighbouring groups in both lhs and grad (so their
non-finite values cannot enter as 0 x inf). No atomics: every output block has
one writer; rows past the group-size sum and blocks of empty groups come out zero.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import metadata

ZERO_FILLED = True  # every output element is written (ops.py needs no extra masking pass)


def _params(num_warps, num_stages):
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _gmm_kernel(lo_ref, hi_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref, *, tile_m,
                tile_k, num_k, transpose_rhs):
  n_tile, m_tile = pl.program_id(0), pl.program_id(1)
  tile_n = out_ref.shape[1]
  rows = m_tile * tile_m + jax.lax.broadcasted_iota(jnp.int32, (tile_m, 1), 0)
  n0 = pl.multiple_of(n_tile * tile_n, tile_n)

  def group(g, acc):
    def k_step(kk, acc_g):
      k0 = pl.multiple_of(kk * tile_k, tile_k)
      a = lhs_ref[:, pl.ds(k0, tile_k)]
      if transpose_rhs:
        b = rhs_ref[g, pl.ds(n0, tile_n), pl.ds(k0, tile_k)]
        return acc_g + jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                           preferred_element_type=jnp.float32)
      b = rhs_ref[g, pl.ds(k0, tile_k), pl.ds(n0, tile_n)]
      return acc_g + jnp.dot(a, b, preferred_element_type=jnp.float32)

    acc_g = jax.lax.fori_loop(0, num_k, k_step, jnp.zeros(acc.shape, jnp.float32))
    mask = (rows >= starts_ref[g]) & (rows < ends_ref[g])
    return acc + jnp.where(mask, acc_g, 0.0)

  acc = jnp.zeros(out_ref.shape, jnp.float32)
  acc = jax.lax.fori_loop(lo_ref[m_tile], hi_ref[m_tile] + 1, group, acc)
  out_ref[...] = acc.astype(out_ref.dtype)


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, tile_m: int = 128, tile_n: int = 128,
        tile_k: int = 64, num_warps: int = 4, num_stages: int = 3,
        transpose_rhs: bool = False, out_dtype=None, interpret=False):
  """lhs @ rhs[g] per group (rhs[g].T with `transpose_rhs`, rhs then [G, N, K]); M must be a
  multiple of tile_m (ops.py pads); tile_n / tile_k fall back to N / K if they don't divide."""
  m, k = lhs_MK.shape
  n = rhs_GKN.shape[1 if transpose_rhs else 2]
  tile_n, tile_k = metadata.fit_tile(tile_n, n), metadata.fit_tile(tile_k, k)
  lo, hi = metadata.tile_group_range(group_sizes_G, m, tile_m)
  starts, ends = metadata.group_bounds(group_sizes_G)
  whole = lambda a: pl.BlockSpec(a.shape, lambda j, i: (0,) * a.ndim)
  kernel = functools.partial(_gmm_kernel, tile_m=tile_m, tile_k=tile_k, num_k=k // tile_k,
                             transpose_rhs=transpose_rhs)
  return pl.pallas_call(
      kernel,
      grid=(n // tile_n, m // tile_m),
      in_specs=[whole(lo), whole(hi), whole(starts), whole(ends),
                pl.BlockSpec((tile_m, k), lambda j, i: (i, 0)), whole(rhs_GKN)],
      out_specs=pl.BlockSpec((tile_m, tile_n), lambda j, i: (i, j)),
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype or lhs_MK.dtype),
      compiler_params=_params(num_warps, num_stages),
      interpret=interpret)(lo, hi, starts, ends, lhs_MK, rhs_GKN)


def _tgmm_kernel(starts_ref, ends_ref, lhs_ref, grad_ref, out_ref, *, tile_m):
  g = pl.program_id(2)
  start, end = starts_ref[g], ends_ref[g]

  def body(t, acc):
    row0 = pl.multiple_of(t * tile_m, tile_m)
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (tile_m, 1), 0)
    mask = (rows >= start) & (rows < end)
    # both operands: 0 x inf would let another group's non-finite rows into this sum
    lhs = jnp.where(mask, lhs_ref[pl.ds(row0, tile_m), :], 0).astype(lhs_ref.dtype)
    grad = jnp.where(mask, grad_ref[pl.ds(row0, tile_m), :], 0).astype(grad_ref.dtype)
    return acc + jnp.dot(lhs.T, grad, preferred_element_type=jnp.float32)

  first, last = start // tile_m, (end + tile_m - 1) // tile_m
  acc = jax.lax.fori_loop(first, last, body, jnp.zeros(out_ref.shape, jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


def tgmm(lhs_MK, grad_MN, group_sizes_G, *, tile_m: int = 64, tile_n: int = 128,
         tile_k: int = 128, num_warps: int = 4, num_stages: int = 3, out_dtype=jnp.float32,
         interpret=False):
  """Per-group lhs^T @ grad -> [G, K, N]; empty groups give zeros. M a multiple of tile_m."""
  m, k = lhs_MK.shape
  n = grad_MN.shape[1]
  tile_n, tile_k = metadata.fit_tile(tile_n, n), metadata.fit_tile(tile_k, k)
  num_groups = group_sizes_G.shape[0]
  starts, ends = metadata.group_bounds(group_sizes_G)
  whole = lambda a: pl.BlockSpec(a.shape, lambda j, a_, g: (0,) * a.ndim)
  return pl.pallas_call(
      functools.partial(_tgmm_kernel, tile_m=tile_m),
      grid=(n // tile_n, k // tile_k, num_groups),
      in_specs=[whole(starts), whole(ends),
                pl.BlockSpec((m, tile_k), lambda j, a, g: (0, a)),
                pl.BlockSpec((m, tile_n), lambda j, a, g: (0, j))],
      out_specs=pl.BlockSpec((None, tile_k, tile_n), lambda j, a, g: (g, a, j)),
      out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
      compiler_params=_params(num_warps, num_stages),
      interpret=interpret)(starts, ends, lhs_MK, grad_MN)
