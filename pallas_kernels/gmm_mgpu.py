"""Grouped matmul kernels for Hopper GPUs (Pallas Mosaic GPU: TMA copies, wgmma), target 'mgpu'.

`gmm`: one CTA per (N tile, work item), or with `persistent` one CTA per SM looping over them
(N tiles innermost; measured faster on an H200: 295 vs 236 TFLOP/s), a work item being one
(row tile, group) pair that shares rows (metadata.work_items over the groups plus one virtual
group for the rows past the group-size sum, which is stored as zeros). K streams through a
TMA pipeline (`max_concurrent_steps` stages) into wgmma with a float32 accumulator; the rows
of the tile that belong to the item's group go out by TMA stores of static power-of-two row
counts (the binary digits of the dynamic count), so every output row has exactly one writer.
`tgmm`: one CTA per (K tile, N tile, group) (or persistent, as above; not yet timed on a
device); the group's row tiles stream through a pipeline of
dynamic length, rows of neighbouring groups in the two edge tiles are zeroed in shared memory
(in lhs and grad, so their non-finite values cannot enter as 0 x inf) before lhs^T @ grad
goes to wgmma; empty groups store zeros.
16-bit inputs (wgmma transposes no others; ops.py sends other dtypes to the Triton family).
On CPU the kernels run under Mosaic GPU's interpreter, whose wgmma takes no transposed
operands: there the transposes happen in XLA first (on the device, inside the kernel).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import metadata

ZERO_FILLED = True  # every output element is written (ops.py needs no extra masking pass)


def compiler_params():
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def interpret_params(interpret):
  if interpret is True:
    from jax._src.pallas.mosaic_gpu.interpret import params  # pylint: disable=import-outside-toplevel
    return params.InterpretGPUParams()
  return interpret or None


def num_sms() -> int:
  """Multiprocessors of the default device (4 when it reports none, e.g. the CPU)."""
  return getattr(jax.devices()[0], 'core_count', None) or 4


def store_rows(o_smem, out_gmem, first, count, row0, col0, tile_m, tile_n):
  """TMA-stores rows [first, first + count) of o_smem to out rows row0 + first + ..., as
  static power-of-two row counts (count is dynamic, 0..tile_m)."""
  size = tile_m
  while size >= 1:
    @pl.when((count & size) != 0)
    def _store(size=size, first=first):
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(first, size)],
                              out_gmem.at[pl.ds(row0 + first, size), pl.ds(col0, tile_n)])
    first = first + (count & size)
    size //= 2


def _gmm_kernel(*refs, num_n, persistent, **kw):
  """One (N tile, work item) per CTA, or, `persistent`, one CTA per SM looping over them
  (N tiles innermost, so CTAs running together share lhs row tiles in L2)."""
  if not persistent:
    _gmm_block(lax.axis_index('n'), lax.axis_index('i'), *refs, **kw)
    return
  num_items = refs[0].shape[0]

  @plgpu.nd_loop((num_items * num_n,), collective_axes='sm')
  def _loop(info):
    (idx,) = info.index
    _gmm_block(idx % num_n, idx // num_n, *refs, **kw)


def _gmm_block(n_tile, item, group_gmem, tile_gmem, first_gmem, count_gmem, lhs_gmem, rhs_gmem,
               out_gmem, *, tile_m, tile_n, tile_k, stages, transpose_rhs, num_groups):
  group, tile = group_gmem[item], tile_gmem[item]
  first, count = first_gmem[item], count_gmem[item]
  num_k = lhs_gmem.shape[1] // tile_k

  def accumulate(acc_ref):
    def step(_, lhs_smem, rhs_smem):
      rhs = rhs_smem.transpose((1, 0)) if transpose_rhs else rhs_smem
      plgpu.wgmma(acc_ref, lhs_smem, rhs)

    rhs_spec = (plgpu.BlockSpec((tile_n, tile_k), lambda k: (n_tile, k), delay_release=1)
                if transpose_rhs else
                plgpu.BlockSpec((tile_k, tile_n), lambda k: (k, n_tile), delay_release=1))
    plgpu.emit_pipeline(
        step, grid=(num_k,),
        in_specs=[plgpu.BlockSpec((tile_m, tile_k), lambda k: (tile, k), delay_release=1),
                  rhs_spec],
        max_concurrent_steps=stages)(lhs_gmem, rhs_gmem.at[group])
    return acc_ref[...]

  @pl.when(count > 0)
  def _item():
    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((tile_m, tile_n), out_gmem.dtype))
    def _out(o_smem):
      @pl.when(group < num_groups)
      def _matmul():
        acc = pl.run_scoped(accumulate, plgpu.ACC((tile_m, tile_n)))
        o_smem[...] = acc.astype(o_smem.dtype)

      @pl.when(group >= num_groups)  # the rows past the group-size sum
      def _zeros():
        o_smem[...] = jnp.zeros((tile_m, tile_n), o_smem.dtype)

      plgpu.commit_smem()
      store_rows(o_smem, out_gmem, first, count, tile * tile_m, n_tile * tile_n, tile_m, tile_n)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def row_items(group_sizes_G, m: int, tile_m: int):
  """Work items of a gmm over m rows (metadata.work_items with the rows past the group-size
  sum as one more group, index G): int32 group_I, tile_I, first_I (first row of the item
  within its tile) and count_I (its rows; 0 for padding items)."""
  sizes = group_sizes_G.astype(jnp.int32)
  sizes = jnp.concatenate([sizes, (m - jnp.sum(sizes))[None]])  # + the tail as a group
  group, tile, valid, starts, ends = metadata.work_items(sizes, m, tile_m)
  row0 = tile * tile_m
  first = jnp.maximum(starts[group], row0)
  count = jnp.where(valid, jnp.minimum(ends[group], row0 + tile_m) - first, 0)
  return group, tile, (first - row0).astype(jnp.int32), count.astype(jnp.int32)


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, tile_m: int = 128, tile_n: int = 128,
        tile_k: int = 64, stages: int = 4, persistent: bool = False,
        transpose_rhs: bool = False, transpose_in_kernel: bool = True, out_dtype=None,
        interpret=False):
  """lhs @ rhs[g] per group (rhs[g].T with `transpose_rhs`, rhs then [G, N, K]); M must be a
  multiple of tile_m (ops.py pads); rows past the group-size sum come out zero.
  `transpose_in_kernel` False (and always in interpret mode, whose wgmma takes no transposed
  operands) transposes rhs in XLA first. `persistent`: one CTA per SM."""
  if transpose_rhs and (interpret or not transpose_in_kernel):
    rhs_GKN, transpose_rhs = jnp.swapaxes(rhs_GKN, 1, 2), False
  m, k = lhs_MK.shape
  num_groups = rhs_GKN.shape[0]
  n = rhs_GKN.shape[1 if transpose_rhs else 2]
  tile_n, tile_k = metadata.fit_tile(tile_n, n), metadata.fit_tile(tile_k, k)
  items = row_items(group_sizes_G, m, tile_m)
  kernel = functools.partial(_gmm_kernel, tile_m=tile_m, tile_n=tile_n, tile_k=tile_k,
                             stages=stages, transpose_rhs=transpose_rhs,
                             num_groups=num_groups, num_n=n // tile_n, persistent=persistent)
  grid = ((num_sms(),), ('sm',)) if persistent else ((n // tile_n, items[0].shape[0]), ('n', 'i'))
  return plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, n), out_dtype or lhs_MK.dtype),
      grid=grid[0], grid_names=grid[1],
      compiler_params=compiler_params(), interpret=interpret_params(interpret),
  )(*items, lhs_MK, rhs_GKN)


def _tgmm_kernel(*refs, num_k, num_n, persistent, **kw):
  """One (K tile, N tile, group) per CTA, or, `persistent`, one CTA per SM looping over them
  (group outermost, N innermost: CTAs running together read the same group's rows)."""
  if not persistent:
    _tgmm_block(lax.axis_index('k'), lax.axis_index('n'), lax.axis_index('g'), *refs, **kw)
    return
  num_groups = refs[0].shape[0]

  @plgpu.nd_loop((num_groups * num_k * num_n,), collective_axes='sm')
  def _loop(info):
    (idx,) = info.index
    _tgmm_block((idx // num_n) % num_k, idx % num_n, idx // (num_n * num_k), *refs, **kw)


def _tgmm_block(k_tile, n_tile, g, starts_gmem, ends_gmem, lhs_gmem, grad_gmem, out_gmem, *,
                tile_m, tile_k, tile_n, stages, lhs_transposed):
  """lhs_gmem is [M, K], or [K, M] when `lhs_transposed` (then wgmma takes it as is)."""
  start, end = starts_gmem[g], ends_gmem[g]
  first = start // tile_m
  num_chunks = jnp.where(end > start, (end + tile_m - 1) // tile_m - first, 0)
  lhs_block, row_axis = ((tile_k, tile_m), 1) if lhs_transposed else ((tile_m, tile_k), 0)

  def accumulate(acc_ref):
    def step(idx, lhs_smem, grad_smem):
      row0 = (first + idx[0]) * tile_m

      @pl.when((row0 < start) | (row0 + tile_m > end))  # an edge tile: zero other groups' rows
      def _mask():  # in both operands (0 x inf would let their non-finite rows in)
        for ref, axis in ((lhs_smem, row_axis), (grad_smem, 0)):
          rows = row0 + lax.broadcasted_iota(jnp.int32, ref.shape, axis)
          keep = (rows >= start) & (rows < end)
          ref[...] = jnp.where(keep, ref[...], jnp.zeros_like(ref[...]))
        plgpu.commit_smem()

      lhs = lhs_smem if lhs_transposed else lhs_smem.transpose((1, 0))
      plgpu.wgmma(acc_ref, lhs, grad_smem)

    lhs_index = ((lambda c: (k_tile, first + c)) if lhs_transposed
                 else (lambda c: (first + c, k_tile)))
    plgpu.emit_pipeline(
        step, grid=(num_chunks,),
        in_specs=[plgpu.BlockSpec(lhs_block, lhs_index, delay_release=1),
                  plgpu.BlockSpec((tile_m, tile_n), lambda c: (first + c, n_tile),
                                  delay_release=1)],
        max_concurrent_steps=stages)(lhs_gmem, grad_gmem)
    return acc_ref[...]

  @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((tile_k, tile_n), out_gmem.dtype))
  def _out(o_smem):
    @pl.when(num_chunks > 0)
    def _matmul():
      acc = pl.run_scoped(accumulate, plgpu.ACC((tile_k, tile_n)))
      o_smem[...] = acc.astype(o_smem.dtype)

    @pl.when(num_chunks == 0)
    def _zeros():
      o_smem[...] = jnp.zeros((tile_k, tile_n), o_smem.dtype)

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
        o_smem, out_gmem.at[g, pl.ds(k_tile * tile_k, tile_k), pl.ds(n_tile * tile_n, tile_n)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def tgmm(lhs_MK, grad_MN, group_sizes_G, *, tile_m: int = 64, tile_n: int = 128,
         tile_k: int = 128, stages: int = 4, persistent: bool = False,
         transpose_in_kernel: bool = True, out_dtype=jnp.float32, interpret=False):
  """Per-group lhs^T @ grad -> [G, K, N]; empty groups give zeros. M a multiple of tile_m.
  `transpose_in_kernel` False (and always in interpret mode) transposes lhs in XLA first.
  `persistent`: one CTA per SM."""
  _, k = lhs_MK.shape
  n = grad_MN.shape[1]
  tile_n, tile_k = metadata.fit_tile(tile_n, n), metadata.fit_tile(tile_k, k)
  num_groups = group_sizes_G.shape[0]
  starts, ends = metadata.group_bounds(group_sizes_G)
  lhs_transposed = bool(interpret) or not transpose_in_kernel
  kernel = functools.partial(_tgmm_kernel, tile_m=tile_m, tile_k=tile_k, tile_n=tile_n,
                             stages=stages, lhs_transposed=lhs_transposed, num_k=k // tile_k,
                             num_n=n // tile_n, persistent=persistent)
  grid = (((num_sms(),), ('sm',)) if persistent
          else ((k // tile_k, n // tile_n, num_groups), ('k', 'n', 'g')))
  return plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
      grid=grid[0], grid_names=grid[1],
      compiler_params=compiler_params(), interpret=interpret_params(interpret),
  )(starts, ends, lhs_MK.T if lhs_transposed else lhs_MK, grad_MN)
