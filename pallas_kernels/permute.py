"""Permute tokens into expert-sorted order and combine (weighted un-permute) them back.

    permute(x_TD, positions_Tk) -> x_MD        row positions[t, j] of the output is x[t]
    combine(out_MD, positions_Tk, weights_Tk)  y[t] = sum_j weights[t, j] * out[positions[t, j]]

positions_Tk (from pallas_kernels.route) is a permutation of range(T*k), so both are row
gathers y[r] = sum_j w[r, j] * x[idx[r, j]] (float32 sums), done by one Pallas kernel per
family with an optional per-row weight:
- 'gpu' (Triton-style): a program per (block of output rows, slab of D); it loops over its rows
  and reads whole source rows with scalar row indices (pl.ds(idx, 1)). D is padded to a
  power-of-two multiple when it is not one.
- 'tpu' (Mosaic): x stays in HBM (pl.ANY); the indices are scalar-prefetched into SMEM and each
  grid step DMAs the rows of its block of output rows into VMEM (straight into the output
  block for permute, into a [k, rows, D] scratch that is reduced in float32 for combine).
  Rows of a 16- or 8-bit dtype move as 32-bit words (permute) or float32 (combine): Mosaic
  DMAs no single packed row into a VMEM block.
  The R*k int32 indices sit in SMEM (1 MiB on current chips: ~250k assignments per call).
Backward (custom_vjp): d_x of permute = combine(g, positions, ones); for combine, the
cotangent is permuted once (g_MD) and both d_out[m] = w_M[m] * g_MD[m] and
d_w[t, j] = <g[t], out[positions[t, j]]> are elementwise passes over it. The sorted-row ->
(token, choice) map is one int32 scatter of positions (no sort).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.metadata import next_pow2
from pallas_kernels.ops import interpret_flag, resolve_interpret, resolve_target

GPU_BLOCK_ROWS = 8     # output rows per Triton program (a loop of scalar-indexed row copies)
GPU_BLOCK_D = 1024     # widest row slab per Triton program (power of two)
GPU_NUM_WARPS, GPU_NUM_STAGES = 4, 2
TPU_MAX_ROWS = 256     # output rows per TPU grid step, at most ...
TPU_VMEM_BYTES = 8 << 20  # ... and fewer when the row buffers would pass this VMEM budget


def _pow2_below(n: int) -> int:
  return 1 << (max(n, 1).bit_length() - 1)


def _gpu_width(d: int) -> tuple[int, int]:
  """(padded D, slab width): a slab is a power of two dividing padded D, at most GPU_BLOCK_D."""
  unit = min(next_pow2(d), 128)
  d_pad = -(-d // unit) * unit
  return d_pad, min(GPU_BLOCK_D, d_pad & -d_pad)


def _gather_gpu_kernel(idx_ref, *refs, num_rows, block_r, num_j, weighted):
  w_ref, x_ref, out_ref = refs if weighted else (None, *refs)
  r0 = pl.program_id(0) * block_r

  def body(r, carry):
    acc = None
    for j in range(num_j):
      flat = (r0 + r) * num_j + j
      row = x_ref[pl.ds(idx_ref[flat], 1), :]
      if weighted:
        row = row.astype(jnp.float32) * w_ref[flat]
      elif num_j > 1:
        row = row.astype(jnp.float32)
      acc = row if acc is None else acc + row
    out_ref[pl.ds(r, 1), :] = acc.astype(out_ref.dtype)
    return carry

  jax.lax.fori_loop(0, jnp.minimum(block_r, num_rows - r0), body, 0)


def _gather_gpu(x_ND, idx_RJ, w_RJ, out_dtype, interpret):
  (n, d), (r, num_j) = x_ND.shape, idx_RJ.shape
  d_pad, block_d = _gpu_width(d)
  x = jnp.pad(x_ND, ((0, 0), (0, d_pad - d))) if d_pad != d else x_ND
  block_r = min(GPU_BLOCK_ROWS, next_pow2(r))
  weighted = w_RJ is not None
  scalars = [idx_RJ.reshape(-1)] + ([w_RJ.reshape(-1).astype(jnp.float32)] if weighted else [])
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, c: (0,) * a.ndim)
  kernel = functools.partial(_gather_gpu_kernel, num_rows=r, block_r=block_r, num_j=num_j,
                             weighted=weighted)
  out = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(r, block_r), d_pad // block_d),
      in_specs=[whole(a) for a in scalars] + [pl.BlockSpec((n, block_d), lambda i, c: (0, c))],
      out_specs=pl.BlockSpec((block_r, block_d), lambda i, c: (i, c)),
      out_shape=jax.ShapeDtypeStruct((r, d_pad), out_dtype),
      compiler_params=pltriton.CompilerParams(num_warps=GPU_NUM_WARPS,
                                              num_stages=GPU_NUM_STAGES),
      interpret=interpret)(*scalars, x)
  return out[:, :d] if d_pad != d else out


def _gather_tpu_kernel(idx_ref, *refs, num_rows, block_r, num_j, weighted, direct):
  if direct:
    x_hbm, out_ref, sem = refs
  else:
    *w_ref, x_hbm, out_ref, buf_ref, sem = refs  # w_ref: [] or [weights block]
  r0 = pl.program_id(0) * block_r

  def copy(r, j):
    src = x_hbm.at[pl.ds(idx_ref[(r0 + r) * num_j + j], 1)]
    dst = out_ref.at[pl.ds(r, 1)] if direct else buf_ref.at[j, pl.ds(r, 1)]
    return pltpu.make_async_copy(src, dst, sem)

  def start(r, carry):
    for j in range(num_j):
      copy(r, j).start()
    return carry

  def wait(r, carry):
    for j in range(num_j):
      copy(r, j).wait()
    return carry

  rows = jnp.minimum(block_r, num_rows - r0)
  jax.lax.fori_loop(0, rows, start, 0)  # every DMA of the block in flight, then drain
  jax.lax.fori_loop(0, rows, wait, 0)
  if not direct:
    acc = jnp.zeros(out_ref.shape, jnp.float32)
    for j in range(num_j):
      row = buf_ref[j].astype(jnp.float32)
      acc = acc + (row * w_ref[0][:, j:j + 1] if weighted else row)
    out_ref[...] = acc.astype(out_ref.dtype)


def _gather_tpu(x_ND, idx_RJ, w_RJ, out_dtype, interpret):
  (_, d), (r, num_j) = x_ND.shape, idx_RJ.shape
  weighted = w_RJ is not None
  direct = num_j == 1 and not weighted
  per_row = d * (x_ND.dtype.itemsize * (0 if direct else num_j)
                 + 2 * jnp.dtype(out_dtype).itemsize + (0 if direct else 4))
  min_rows = 32 // min(x_ND.dtype.itemsize, 4)  # one packed (8, 128) tile of sublanes
  block_r = max(min_rows, min(TPU_MAX_ROWS, _pow2_below(TPU_VMEM_BYTES // per_row)))
  block_r = r if r <= block_r else block_r  # a block as tall as the array is always legal
  in_specs = [pl.BlockSpec(memory_space=pl.ANY)]
  operands = [x_ND]
  if weighted:
    in_specs.insert(0, pl.BlockSpec((block_r, num_j), lambda i, idx: (i, 0)))
    operands.insert(0, w_RJ.astype(jnp.float32))
  scratch = [] if direct else [pltpu.VMEM((num_j, block_r, d), x_ND.dtype)]
  spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(pl.cdiv(r, block_r),), in_specs=in_specs,
      out_specs=pl.BlockSpec((block_r, d), lambda i, idx: (i, 0)),
      scratch_shapes=scratch + [pltpu.SemaphoreType.DMA(())])
  kernel = functools.partial(_gather_tpu_kernel, num_rows=r, block_r=block_r, num_j=num_j,
                             weighted=weighted, direct=direct)
  return pl.pallas_call(
      kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct((r, d), out_dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=('parallel',)),
      interpret=interpret)(idx_RJ.reshape(-1), *operands)


def _gather_tpu_packed(x_ND, idx_RJ, w_RJ, out_dtype, interpret):
  """_gather_tpu for a dtype of under 32 bits, whose rows Mosaic cannot DMA one at a time
  into a VMEM block (a packed row at an unaligned sublane): a plain row copy as 32-bit words
  (the row's bytes bitcast, exact), a weighted or summed gather on float32 rows (the kernel
  sums in float32 anyway)."""
  n, d = x_ND.shape
  per_word = 4 // x_ND.dtype.itemsize
  if idx_RJ.shape[1] == 1 and w_RJ is None and d % per_word == 0 and out_dtype == x_ND.dtype:
    words = jax.lax.bitcast_convert_type(x_ND.reshape(n, d // per_word, per_word), jnp.uint32)
    out = _gather_tpu(words, idx_RJ, None, jnp.uint32, interpret)
    return jax.lax.bitcast_convert_type(out, x_ND.dtype).reshape(-1, d)
  direct = idx_RJ.shape[1] == 1 and w_RJ is None
  out = _gather_tpu(x_ND.astype(jnp.float32), idx_RJ, w_RJ,
                    jnp.float32 if direct else out_dtype, interpret)
  return out.astype(out_dtype)


def _gather(x_ND, idx_RJ, w_RJ, cfg, out_dtype=None):
  """y[r] = sum_j w[r, j] * x[idx[r, j]] (w None: ones), float32 sums, [R, D] in out_dtype."""
  target, interpret = cfg
  out_dtype = out_dtype or x_ND.dtype
  if idx_RJ.shape[0] == 0 or x_ND.shape[1] == 0:
    return jnp.zeros((idx_RJ.shape[0], x_ND.shape[1]), out_dtype)
  impl = _gather_gpu
  if target == 'tpu':
    impl = _gather_tpu if x_ND.dtype.itemsize >= 4 else _gather_tpu_packed
  return impl(x_ND, idx_RJ.astype(jnp.int32), w_RJ, out_dtype,
              resolve_interpret(target, interpret))


def _sorted_to_flat(positions_Tk):
  """flat_M[m] = t*k + j for the (t, j) with positions[t, j] == m (inverse permutation)."""
  m = positions_Tk.size
  return jnp.zeros((m,), jnp.int32).at[positions_Tk.reshape(-1)].set(
      jnp.arange(m, dtype=jnp.int32), unique_indices=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _permute(x_TD, positions_Tk, cfg):
  token_M1 = (_sorted_to_flat(positions_Tk) // positions_Tk.shape[1])[:, None]
  return _gather(x_TD, token_M1, None, cfg)


def _permute_fwd(x_TD, positions_Tk, cfg):
  return _permute(x_TD, positions_Tk, cfg), positions_Tk


def _permute_bwd(cfg, positions_Tk, g_MD):
  with jax.named_scope('permute_bwd'):
    return _gather(g_MD, positions_Tk, None, cfg), None


_permute.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine(out_MD, positions_Tk, weights_Tk, cfg):
  return _gather(out_MD, positions_Tk, weights_Tk, cfg)


def _combine_fwd(out_MD, positions_Tk, weights_Tk, cfg):
  return _combine(out_MD, positions_Tk, weights_Tk, cfg), (out_MD, positions_Tk, weights_Tk)


def _combine_bwd(cfg, res, g_TD):
  out_MD, positions_Tk, weights_Tk = res
  with jax.named_scope('combine_bwd'):
    flat_M = _sorted_to_flat(positions_Tk)
    g_MD = _gather(g_TD, (flat_M // positions_Tk.shape[1])[:, None], None, cfg)
    g_MD = g_MD.astype(jnp.float32)
    w_M1 = weights_Tk.reshape(-1)[flat_M].astype(jnp.float32)[:, None]
    d_out = (g_MD * w_M1).astype(out_MD.dtype)
    d_w = jnp.sum(g_MD * out_MD.astype(jnp.float32), axis=1)[positions_Tk]
  return d_out, None, d_w.astype(weights_Tk.dtype)


_combine.defvjp(_combine_fwd, _combine_bwd)


def _check(op: str, name: str, rows, positions_Tk, weights_Tk=None):
  """A ValueError naming the operand unless positions is [T, k] integer, `rows` is 2-D with
  T rows (permute's x) or T*k rows (combine's out) and weights (if given) has positions'
  shape."""
  if positions_Tk.ndim != 2 or not jnp.issubdtype(positions_Tk.dtype, jnp.integer):
    raise ValueError(f'pallas_kernels.{op}: positions must be a [T, k] integer array, got '
                     f'shape {positions_Tk.shape} dtype {positions_Tk.dtype}')
  want_rows = positions_Tk.size if op == 'combine' else positions_Tk.shape[0]
  if rows.ndim != 2 or rows.shape[0] != want_rows:
    raise ValueError(f'pallas_kernels.{op}: {name} must be 2-D with {want_rows} rows for '
                     f'positions of shape {positions_Tk.shape}, got shape {rows.shape}')
  if weights_Tk is not None and weights_Tk.shape != positions_Tk.shape:
    raise ValueError(f'pallas_kernels.{op}: weights shape {weights_Tk.shape} != positions '
                     f'shape {positions_Tk.shape}')


def permute(x_TD, positions_Tk, *, target: str | None = None, interpret=None,
            platform: str | None = None):
  """x rows in expert-sorted order, [T*k, D]: row positions[t, j] is x[t]. `target`,
  `interpret`, `platform` as in route."""
  _check('permute', 'x', x_TD, positions_Tk)
  with jax.named_scope('permute'):
    return _permute(x_TD, positions_Tk, (resolve_target(target, platform),
                                         interpret_flag(interpret, platform)))


def combine(out_MD, positions_Tk, weights_Tk, *, target: str | None = None, interpret=None,
            platform: str | None = None):
  """sum_j weights[t, j] * out[positions[t, j]], accumulated in float32, [T, D] in out's dtype."""
  _check('combine', 'out', out_MD, positions_Tk, weights_Tk)
  with jax.named_scope('combine'):
    return _combine(out_MD, positions_Tk, weights_Tk, (resolve_target(target, platform),
                                                       interpret_flag(interpret, platform)))
