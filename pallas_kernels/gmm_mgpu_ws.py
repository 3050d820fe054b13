"""Warp-specialised grouped matmul kernels for Hopper GPUs (Pallas Mosaic GPU), target 'mgpu_ws'.

Same contracts and work decomposition as gmm_mgpu ('mgpu'), with the CTA split into three
warpgroups: one issues the TMA loads (few registers), two run wgmma on halves of a tile twice
as large as one warpgroup's accumulator, so loads, math and the epilogue overlap and every
operand tile read from shared memory feeds twice the math. Persistent: one CTA per SM walks
its work in a loop.

`gmm`: CTA tile tile_m x 2 tile_n (warpgroup w owns columns [w tile_n, (w + 1) tile_n)); work
items are gmm_mgpu.row_items, N tiles innermost; each warpgroup stores its group's rows of the
tile with the power-of-two TMA row stores of gmm_mgpu.store_rows, waiting for its previous
store only when it reuses the staging buffer (so the store overlaps the next tile's loads).
`tgmm`: CTA tile 2 tile_k x tile_n of a group's lhs^T @ grad (warpgroup w owns rows
[w tile_k, (w + 1) tile_k) of the K tile, i.e. its own columns of the lhs block, so each zeroes
the rows of neighbouring groups in its own slice of shared memory, and both zero them in the
shared grad tile, in the two edge tiles only);
the group's row tiles stream through a pipeline of dynamic length; empty groups store zeros.
The output leaves in row slices of `epi_k` rows (float32 outputs need less staging memory).
16-bit inputs only (ops.py sends others to Triton). An N (gmm) or K (tgmm) that two
warpgroup tiles of at least 8 do not divide runs gmm_mgpu's persistent kernel instead. Under Mosaic GPU's interpreter (CPU),
whose wgmma takes no transposed operands, the transposes happen in XLA first.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gmm_mgpu, metadata
from pallas_kernels.gmm_mgpu import (compiler_params, interpret_params, num_sms, row_items,
                                     store_rows)

ZERO_FILLED = True
COMPUTE_WGS = 2  # warpgroups running wgmma; one more issues the loads
MEMORY_REGISTERS = 40  # per thread of the load warpgroup (the rest go to the compute ones)


def _ignore(*_, **__):
  return None


def _kernel(body, *, out_shape, interpret):
  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct(*out_shape), grid=(num_sms(),), grid_names=('sm',),
      num_threads=COMPUTE_WGS + 1, thread_name='wg', compiler_params=compiler_params(),
      interpret=interpret_params(interpret))


def _pipeline(body, context, *, num_steps, in_specs, stages):
  """A pipeline whose step releases its buffers when it returns (no delay_release: the load
  warpgroup refills every slot in the next call's prologue, so none may still be read)."""
  return plgpu.emit_pipeline_warp_specialized(
      body, grid=(num_steps,), memory_registers=MEMORY_REGISTERS, in_specs=in_specs,
      wg_axis='wg', num_compute_wgs=COMPUTE_WGS, max_concurrent_steps=stages,
      compute_context=context)


def _accumulate_then(store, shape):
  """The pipeline's compute context: a float32 accumulator of `shape` that the pipeline's
  steps fill, then handed to store (a compute warpgroup's epilogue)."""
  def context(run):
    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC(shape))
    def _acc(acc_ref):
      run(acc_ref)
      store(acc_ref[...])
  return context


def _split(tile: int, dim: int, floor: int = 8) -> int | None:
  """One warpgroup's tile: the largest of tile, tile / 2, ... (down to `floor`, wgmma's N
  granularity) whose COMPUTE_WGS-fold divides dim; None if there is none (the caller then
  runs gmm_mgpu's kernel)."""
  while tile >= floor:
    if dim % (COMPUTE_WGS * tile) == 0:
      return tile
    tile //= 2
  return None


def _gmm_body(group_gmem, tile_gmem, first_gmem, count_gmem, lhs_gmem, rhs_gmem, out_gmem, *,
              tile_m, tile_n, tile_k, stages, transpose_rhs, num_groups):
  num_items, n = group_gmem.shape[0], out_gmem.shape[1]
  cta_n = COMPUTE_WGS * tile_n
  num_n = n // cta_n
  rhs_block = (cta_n, tile_k) if transpose_rhs else (tile_k, cta_n)

  def in_specs(tile, n_tile):
    rhs_index = (lambda k: (n_tile, k)) if transpose_rhs else (lambda k: (k, n_tile))
    return [plgpu.BlockSpec((tile_m, tile_k), lambda k: (tile, k)),
            plgpu.BlockSpec(rhs_block, rhs_index)]

  pipeline = functools.partial(_pipeline, num_steps=lhs_gmem.shape[1] // tile_k, stages=stages)
  allocations = pipeline(_ignore, _ignore, in_specs=in_specs(0, 0)).get_allocations(
      lhs_gmem, rhs_gmem.at[0])

  @functools.partial(pl.run_scoped, allocations=allocations,
                     o_smem=plgpu.SMEM((COMPUTE_WGS, tile_m, tile_n), out_gmem.dtype),
                     collective_axes='wg')
  def _scope(allocations, o_smem):
    wg = lax.axis_index('wg')

    @plgpu.nd_loop((num_items * num_n,), collective_axes='sm')
    def _loop(info):
      (idx,) = info.index
      n_tile, item = idx % num_n, idx // num_n
      group, tile = group_gmem[item], tile_gmem[item]
      first, count = first_gmem[item], count_gmem[item]

      def store(tile_value):  # one compute warpgroup's tile_m x tile_n block
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # its previous store read o_smem
        o_smem[wg] = tile_value.astype(o_smem.dtype)
        plgpu.commit_smem()
        store_rows(o_smem.at[wg], out_gmem, first, count, tile * tile_m,
                   (n_tile * COMPUTE_WGS + wg) * tile_n, tile_m, tile_n)

      context = _accumulate_then(store, (tile_m, tile_n))

      def step(_, lhs_smem, rhs_smem, acc_ref):
        cols = pl.ds(wg * tile_n, tile_n)
        rhs = (rhs_smem.at[cols].transpose((1, 0)) if transpose_rhs else rhs_smem.at[:, cols])
        plgpu.wgmma(acc_ref, lhs_smem, rhs)
        plgpu.wgmma_wait(0)  # the slot is released when the step returns
        return acc_ref

      @pl.when((count > 0) & (group < num_groups))
      def _matmul():
        pipeline(step, context, in_specs=in_specs(tile, n_tile))(
            lhs_gmem, rhs_gmem.at[jnp.minimum(group, num_groups - 1)], allocations=allocations)

      @pl.when((count > 0) & (group >= num_groups) & (wg < COMPUTE_WGS))
      def _zeros():  # the rows past the group-size sum
        store(jnp.zeros((tile_m, tile_n), jnp.float32))

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, tile_m: int = 128, tile_n: int = 128,
        tile_k: int = 64, stages: int = 3, transpose_rhs: bool = False,
        transpose_in_kernel: bool = True, out_dtype=None, interpret=False):
  """lhs @ rhs[g] per group (rhs[g].T with `transpose_rhs`, rhs then [G, N, K]); M a multiple
  of tile_m (ops.py pads); rows past the group-size sum come out zero. tile_n is one
  warpgroup's share of the CTA tile's columns."""
  if transpose_rhs and (interpret or not transpose_in_kernel):
    rhs_GKN, transpose_rhs = jnp.swapaxes(rhs_GKN, 1, 2), False
  m, k = lhs_MK.shape
  n = rhs_GKN.shape[1 if transpose_rhs else 2]
  if _split(tile_n, n) is None:
    return gmm_mgpu.gmm(lhs_MK, rhs_GKN, group_sizes_G, tile_m=tile_m, tile_n=tile_n,
                        tile_k=tile_k, stages=stages, persistent=True,
                        transpose_rhs=transpose_rhs, out_dtype=out_dtype, interpret=interpret)
  tile_n, tile_k = _split(tile_n, n), metadata.fit_tile(tile_k, k)
  body = functools.partial(_gmm_body, tile_m=tile_m, tile_n=tile_n, tile_k=tile_k,
                           stages=stages, transpose_rhs=transpose_rhs,
                           num_groups=rhs_GKN.shape[0])
  call = _kernel(body, out_shape=((m, n), out_dtype or lhs_MK.dtype),
                 interpret=interpret)
  return call(*row_items(group_sizes_G, m, tile_m), lhs_MK, rhs_GKN)


def _tgmm_body(starts_gmem, ends_gmem, lhs_gmem, grad_gmem, out_gmem, *, tile_m, tile_k, tile_n,
               epi_k, stages, lhs_transposed):
  """lhs_gmem is [M, K], or [K, M] when `lhs_transposed` (then wgmma takes it as is)."""
  num_groups, k, n = out_gmem.shape
  cta_k = COMPUTE_WGS * tile_k
  num_k, num_n = k // cta_k, n // tile_n
  lhs_block, row_axis = ((cta_k, tile_m), 1) if lhs_transposed else ((tile_m, cta_k), 0)

  def in_specs(first, k_tile, n_tile):  # row tile c of the group's rows, from row tile first
    lhs_index = ((lambda c: (k_tile, first + c)) if lhs_transposed
                 else (lambda c: (first + c, k_tile)))
    return [plgpu.BlockSpec(lhs_block, lhs_index),
            plgpu.BlockSpec((tile_m, tile_n), lambda c: (first + c, n_tile))]

  pipeline = functools.partial(_pipeline, stages=stages)
  # buffers for `stages` steps (the allocation takes min(stages, steps) slots)
  allocations = pipeline(_ignore, _ignore, num_steps=stages, in_specs=in_specs(0, 0, 0)
                         ).get_allocations(lhs_gmem, grad_gmem)

  @functools.partial(pl.run_scoped, allocations=allocations,
                     o_smem=plgpu.SMEM((COMPUTE_WGS, epi_k, tile_n), out_gmem.dtype),
                     collective_axes='wg')
  def _scope(allocations, o_smem):
    wg = lax.axis_index('wg')

    @plgpu.nd_loop((num_groups * num_k * num_n,), collective_axes='sm')
    def _loop(info):
      (idx,) = info.index
      g, k_tile, n_tile = idx // (num_k * num_n), (idx // num_n) % num_k, idx % num_n
      start, end = starts_gmem[g], ends_gmem[g]
      first = start // tile_m
      num_chunks = jnp.where(end > start, (end + tile_m - 1) // tile_m - first, 0)
      row0 = k_tile * cta_k + wg * tile_k

      def store(tile_value):  # one compute warpgroup's tile_k x tile_n block, in row slices
        for e in range(tile_k // epi_k):
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          o_smem[wg] = tile_value[e * epi_k:(e + 1) * epi_k].astype(o_smem.dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_smem.at[wg], out_gmem.at[
              g, pl.ds(row0 + e * epi_k, epi_k), pl.ds(n_tile * tile_n, tile_n)])

      context = _accumulate_then(store, (tile_k, tile_n))

      def step(idx, lhs_smem, grad_smem, acc_ref):
        mine = (lhs_smem.at[pl.ds(wg * tile_k, tile_k)] if lhs_transposed
                else lhs_smem.at[:, pl.ds(wg * tile_k, tile_k)])
        rows0 = (first + idx[0]) * tile_m
        shape = (tile_k, tile_m) if lhs_transposed else (tile_m, tile_k)

        @pl.when((rows0 < start) | (rows0 + tile_m > end))  # edge tile: other groups' rows
        def _mask():  # zeroed in both operands (0 x inf would let their non-finite rows in)
          # grad is shared: both warpgroups write it the same values, each before its wgmma
          for ref, ref_shape, axis in ((mine, shape, row_axis), (grad_smem, grad_smem.shape, 0)):
            rows = rows0 + lax.broadcasted_iota(jnp.int32, ref_shape, axis)
            keep = (rows >= start) & (rows < end)
            ref[...] = jnp.where(keep, ref[...], jnp.zeros_like(ref[...]))
          plgpu.commit_smem()

        plgpu.wgmma(acc_ref, mine if lhs_transposed else mine.transpose((1, 0)), grad_smem)
        plgpu.wgmma_wait(0)  # the slot is released when the step returns
        return acc_ref

      @pl.when(num_chunks > 0)
      def _matmul():
        pipeline(step, context, num_steps=num_chunks,
                 in_specs=in_specs(first, k_tile, n_tile))(
                     lhs_gmem, grad_gmem, allocations=allocations)

      @pl.when((num_chunks == 0) & (wg < COMPUTE_WGS))
      def _zeros():
        store(jnp.zeros((tile_k, tile_n), jnp.float32))

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def tgmm(lhs_MK, grad_MN, group_sizes_G, *, tile_m: int = 64, tile_n: int = 128,
         tile_k: int = 128, epi_k: int = 64, stages: int = 3, transpose_in_kernel: bool = True,
         out_dtype=jnp.float32, interpret=False):
  """Per-group lhs^T @ grad -> [G, K, N]; empty groups give zeros. M a multiple of tile_m.
  tile_k is one warpgroup's share of the CTA tile's rows."""
  _, k = lhs_MK.shape
  n = grad_MN.shape[1]
  if _split(tile_k, k) is None:
    return gmm_mgpu.tgmm(lhs_MK, grad_MN, group_sizes_G, tile_m=tile_m, tile_n=tile_n,
                         tile_k=tile_k, stages=stages, persistent=True,
                         transpose_in_kernel=transpose_in_kernel, out_dtype=out_dtype,
                         interpret=interpret)
  tile_n, tile_k = metadata.fit_tile(tile_n, n), _split(tile_k, k)
  epi_k = metadata.fit_tile(epi_k, tile_k)
  starts, ends = metadata.group_bounds(group_sizes_G)
  lhs_transposed = bool(interpret) or not transpose_in_kernel
  body = functools.partial(_tgmm_body, tile_m=tile_m, tile_k=tile_k, tile_n=tile_n,
                           epi_k=epi_k, stages=stages, lhs_transposed=lhs_transposed)
  call = _kernel(body, out_shape=((group_sizes_G.shape[0], k, n), out_dtype),
                 interpret=interpret)
  return call(starts, ends, lhs_MK.T if lhs_transposed else lhs_MK, grad_MN)
