"""Differentiable grouped matmul ops over the Pallas kernels, with `jax.custom_vjp`.

    gmm(lhs_MK, rhs_GKN, group_sizes_G) -> out_MN       (jax.lax.ragged_dot semantics)
    tgmm(lhs_MK, grad_MN, group_sizes_G) -> [G, K, N]   (per-group lhs^T @ grad)
    gmm_swiglu(x_MD, gate_GDF, up_GDF, group_sizes_G)   (fused gate/up: one gmm, N = 2F)

Backward of gmm: d_lhs = gmm(g, rhs, transposed) and d_rhs = tgmm(lhs, g). float32
accumulation whatever the input dtype (float64 operands are refused with a ValueError).
Groups stay isolated as in ragged_dot: a non-finite row of one group (or past the group-size
sum) reaches no other group's output or weight gradient. `platform` is the one the program is
built for ('cpu', 'gpu', 'tpu'; None: this machine's). `target` picks the kernel family:
'tpu' (Mosaic), 'gpu' (Triton), 'mgpu' (Mosaic GPU: TMA + wgmma, Hopper) or 'mgpu_ws' (the
same, warp-specialised); None follows the platform ('tpu' on TPU, GPU_DEFAULT on GPU, or on
this machine's GPU what its compute capability runs: Triton below sm_90, capability.py;
interpreted 'gpu' on CPU). A family this machine's GPU cannot run is refused, naming it;
a compute capability named in `tiles` ('cc': a program built for a named GPU target,
loopmoe_jax.aot) is the one checked and tiled for instead. `interpret` None means: interpret on CPU (TPU kernels under
pltpu.InterpretParams()). Tile sizes are parameters; None takes the per-target default in
TILES. Nothing here is set from outside: every choice is an argument.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import capability, gmm_gpu, gmm_mgpu, gmm_mgpu_ws, gmm_tpu
from pallas_kernels.defaults import OPS, TILES


KERNELS = {'tpu': gmm_tpu, 'gpu': gmm_gpu, 'mgpu': gmm_mgpu, 'mgpu_ws': gmm_mgpu_ws}
SIXTEEN_BIT_ONLY = ('mgpu', 'mgpu_ws')  # wgmma transposes no other operands


def platform_of(platform: str | None) -> str:
  """'cpu', 'gpu' or 'tpu': the platform a kernel is built for (`platform`, 'cuda' / 'rocm'
  read as 'gpu'; None: this machine's, jax.default_backend()). The callers pass it: a program
  built here for a TPU or a GPU names that platform (loopmoe_jax.runtime)."""
  platform = platform or jax.default_backend()
  return {'cuda': 'gpu', 'rocm': 'gpu'}.get(platform, platform)


def families(target: str | None, platform: str | None = None) -> dict[str, str]:
  """The kernel family of each op: `target` for both, else the platform's default (TPU:
  'tpu'; GPU: GPU_DEFAULT per op, on this machine's GPU its compute capability's; CPU: 'gpu',
  interpreted, the quickest family to interpret)."""
  if target is None:
    backend = platform_of(platform)
    if backend == 'gpu':  # on this machine's GPU: the families its compute capability runs
      here = capability.local_cc() if platform_of(None) == 'gpu' else None
      return capability.gpu_families(here) or {op: 'gpu' for op in OPS}
    target = 'tpu' if backend == 'tpu' else 'gpu'
  if target not in KERNELS:
    raise ValueError(f'target={target!r}: must be one of {sorted(KERNELS)}')
  return {op: target for op in OPS}


def resolve_target(target: str | None, platform: str | None = None) -> str:
  """One family for kernels that have no per-op choice (routing, permute: 'tpu' or not)."""
  return families(target, platform)['gmm']


def interpret_flag(interpret, platform: str | None = None):
  """`interpret`, or when None, whether the platform is the CPU (the kernels only interpret
  there)."""
  return platform_of(platform) == 'cpu' if interpret is None else interpret


def resolve_interpret(target: str, interpret, platform: str | None = None):
  """Interpret mode of a `target` kernel (`interpret_flag`): TPU kernels interpret under
  pltpu.InterpretParams()."""
  interpret = interpret_flag(interpret, platform)
  if interpret is True and target == 'tpu':
    return pltpu.InterpretParams()
  return interpret


def tiling(target: str | None, tile_m=None, tile_n=None, overrides=None,
           platform: str | None = None, itemsize: int = 2):
  """Per op, its family and tiles as a hashable tuple: the family from `overrides`
  ({'gmm': {'family': ..., 'tile_m': ...}, 'tgmm': {...}}), else `families(target,
  platform)`; the tiles TILES[family][op], then the overrides, then tile_m / tile_n. An
  override's 'cc' is the compute capability the program is built for (a named GPU target,
  loopmoe_jax.aot), checked and tiled for in place of this machine's GPU (`_here`), for
  operands of `itemsize` bytes."""
  default = families(target, platform)
  unknown = set(overrides or {}) - set(OPS)
  if unknown:
    raise ValueError(f'tiles: unknown op(s) {sorted(unknown)}; the ops are {list(OPS)}')
  ops = []
  for op in OPS:
    cfg = dict((overrides or {}).get(op, {}))
    cc = cfg.pop('cc', None)
    family = cfg.pop('family', default[op])
    if family not in KERNELS:
      raise ValueError(f'family={family!r} for {op}: must be one of {sorted(KERNELS)}')
    cfg = {**TILES[family][op], **_here(family, op, platform, cc, itemsize), **cfg,
           'family': family}
    cfg.update({k: v for k, v in (('tile_m', tile_m), ('tile_n', tile_n)) if v})
    ops.append(tuple(sorted(cfg.items())))
  return tuple(ops)


def _here(family: str, op: str, platform: str | None, cc=None, itemsize: int = 2) -> dict:
  """For a program built for a GPU of compute capability `cc` (a named target's), or else for
  this machine's GPU: a family that capability cannot run refused (naming it), else the tiles
  it changes for operands of `itemsize` bytes ({'num_stages': 2} for Triton on Ada's 99 KiB of
  shared memory, and float32 a shorter contraction tile; capability.gpu_tiles); {}
  elsewhere."""
  if platform_of(platform) != 'gpu':
    return {}
  if cc is None:
    cc = capability.local_cc() if platform_of(None) == 'gpu' else None
  why = cc and capability.family_refusal(family, cc, f' ({op})')
  if why:
    raise ValueError(f'pallas_kernels: {why}')
  tiles = (capability.gpu_tiles(cc, family, itemsize) or {}).get(op, {})
  return {k: v for k, v in tiles.items() if k not in ('family', 'cc')}


def _shape_error(op: str, what: str):
  return ValueError(f'pallas_kernels.{op}: {what}')


def _check_sizes(op: str, group_sizes_G, num_groups: int | None):
  if group_sizes_G.ndim != 1 or not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
    raise _shape_error(op, f'group_sizes must be a 1-D integer array, got shape '
                           f'{group_sizes_G.shape} dtype {group_sizes_G.dtype}')
  if num_groups is not None and group_sizes_G.shape[0] != num_groups:
    raise _shape_error(op, f'group_sizes has {group_sizes_G.shape[0]} groups but rhs has '
                           f'{num_groups} (rhs.shape[0])')


def _check_gmm(op: str, lhs_MK, rhs_GKN, group_sizes_G):
  if lhs_MK.ndim != 2 or rhs_GKN.ndim != 3:
    raise _shape_error(op, f'lhs must be [M, K] and rhs [G, K, N], got lhs.shape '
                           f'{lhs_MK.shape} rhs.shape {rhs_GKN.shape}')
  if lhs_MK.shape[1] != rhs_GKN.shape[1]:
    raise _shape_error(op, f'contracting dimensions differ: lhs.shape[1] = {lhs_MK.shape[1]}, '
                           f'rhs.shape[1] = {rhs_GKN.shape[1]}')
  _check_sizes(op, group_sizes_G, rhs_GKN.shape[0])


def _check_dtype(op: str, *operands):
  """The operands' promoted dtype, refused when float64: the kernels compute in float32 /
  bfloat16, so float64 operands would silently lose precision."""
  dtype = jnp.result_type(*operands)
  if dtype == jnp.float64:
    given = ', '.join(str(x.dtype) for x in operands)
    raise _shape_error(op, f'operands of dtype {dtype} (given {given}) are not supported: the '
                           f'Pallas kernels compute in float32/bfloat16; cast them to float32 '
                           f'(or use the xla / tiled grouped matmul for float64)')
  return dtype


def clip_sizes(group_sizes_G, num_rows: int):
  """int32 group sizes with negatives taken as 0 and the groups ending at num_rows at the
  latest (rows of a group past the end are dropped), so every kernel sees sum <= num_rows."""
  sizes = jnp.clip(group_sizes_G.astype(jnp.int32), 0, num_rows)
  # a running sum clipped at num_rows at every step (associative on [0, num_rows]), so sizes
  # near the int32 limit cannot overflow it
  ends = jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, num_rows), sizes)
  return jnp.diff(ends, prepend=0).astype(jnp.int32)


def _pad_rows(x, multiple):
  pad = -x.shape[0] % multiple
  return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _rows_below(out_MN, group_sizes_G):
  """Zeroes the rows at or past the group-size sum (ragged_dot semantics)."""
  rows = jnp.arange(out_MN.shape[0])[:, None]
  return jnp.where(rows < jnp.sum(group_sizes_G), out_MN, 0).astype(out_MN.dtype)


def _call(cfg, op, dtype, n):
  """(kernel module, keyword arguments, interpret) of one op: its tiles (tile_n falls back to
  N if it doesn't divide). The Mosaic GPU families take 16-bit inputs only: other dtypes run
  the 'gpu' (Triton) kernels at their default tiles."""
  interpret, gmm_cfg, tgmm_cfg = cfg
  kw = dict(gmm_cfg if op == 'gmm' else tgmm_cfg)
  family = kw.pop('family')
  if family in SIXTEEN_BIT_ONLY and jnp.dtype(dtype).itemsize != 2:
    family, kw = 'gpu', dict(TILES['gpu'][op])
  if n % kw['tile_n']:
    kw['tile_n'] = n
  interpret = resolve_interpret(family, interpret)
  _check_tile_m(op, family, kw['tile_m'], interpret)
  return KERNELS[family], kw, interpret


def _check_tile_m(op: str, family: str, tile_m, interpret) -> None:
  """Row tiles the kernels can take: a positive int; on the GPU families a power of two
  (Triton blocks are; the Mosaic GPU gmm stores a tile's rows in power-of-two pieces); for a
  compiled Mosaic GPU gmm a multiple of 64 (wgmma's row block per warpgroup)."""
  where = f'pallas_kernels.{op}: tile_m={tile_m!r} ({family!r} kernels)'
  if not isinstance(tile_m, int) or tile_m < 1:
    raise ValueError(f'{where}: must be a positive integer')
  if family != 'tpu' and tile_m & (tile_m - 1):
    raise ValueError(f'{where}: must be a power of two')
  if op == 'gmm' and family in SIXTEEN_BIT_ONLY and not interpret and tile_m % 64:
    raise ValueError(f'{where}: must be a multiple of 64 when compiled')


def _gmm_impl(lhs_MK, rhs_GKN, group_sizes_G, cfg, transpose_rhs=False, zero_tail=True):
  m = lhs_MK.shape[0]
  n = rhs_GKN.shape[1 if transpose_rhs else 2]
  if m == 0:
    return jnp.zeros((0, n), lhs_MK.dtype)
  kernels, kw, interp = _call(cfg, 'gmm', lhs_MK.dtype, n)
  out = kernels.gmm(_pad_rows(lhs_MK, kw['tile_m']), rhs_GKN, group_sizes_G.astype(jnp.int32),
                    transpose_rhs=transpose_rhs, interpret=interp, **kw)[:m]
  if getattr(kernels, 'ZERO_FILLED', False) or not zero_tail:
    return out
  return _rows_below(out, group_sizes_G)


def _tgmm_impl(lhs_MK, grad_MN, group_sizes_G, cfg, out_dtype=jnp.float32):
  num_groups = group_sizes_G.shape[0]
  m, k = lhs_MK.shape
  n = grad_MN.shape[1]
  if m == 0:
    return jnp.zeros((num_groups, k, n), out_dtype)
  kernels, kw, interp = _call(cfg, 'tgmm', lhs_MK.dtype, n)
  out = kernels.tgmm(_pad_rows(lhs_MK, kw['tile_m']), _pad_rows(grad_MN, kw['tile_m']),
                     group_sizes_G.astype(jnp.int32), out_dtype=out_dtype, interpret=interp,
                     **kw)
  if getattr(kernels, 'ZERO_FILLED', False):
    return out
  return jnp.where((group_sizes_G > 0)[:, None, None], out, 0).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(lhs_MK, rhs_GKN, group_sizes_G, cfg, zero_tail):
  return _gmm_impl(lhs_MK, rhs_GKN, group_sizes_G, cfg, zero_tail=zero_tail)


def _gmm_fwd(lhs_MK, rhs_GKN, group_sizes_G, cfg, zero_tail):
  return (_gmm_impl(lhs_MK, rhs_GKN, group_sizes_G, cfg, zero_tail=zero_tail),
          (lhs_MK, rhs_GKN, group_sizes_G))


def _gmm_bwd(cfg, zero_tail, res, g_MN):
  del zero_tail  # the input gradient's tail is always zero
  lhs_MK, rhs_GKN, group_sizes_G = res
  g_MN = g_MN.astype(lhs_MK.dtype)
  with jax.named_scope('gmm_dlhs'):
    d_lhs = _gmm_impl(g_MN, rhs_GKN, group_sizes_G, cfg, transpose_rhs=True)
  with jax.named_scope('gmm_drhs'):
    d_rhs = _tgmm_impl(lhs_MK, g_MN, group_sizes_G, cfg, out_dtype=rhs_GKN.dtype)
  return d_lhs.astype(lhs_MK.dtype), d_rhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, target: str | None = None, interpret=None,
        tile_m: int | None = None, tile_n: int | None = None, tiles=None,
        zero_tail: bool = True, platform: str | None = None):
  """Grouped matmul with `jax.lax.ragged_dot` semantics, differentiable in lhs and rhs.

  lhs [M, K] rows sorted by group; rhs [G, K, N]; group_sizes [G] int summing to at most M
  (rows past the sum are zero; see clip_sizes for other sizes). Bad shapes, and float64
  operands, raise a ValueError naming them. Output dtype: the promoted input dtype, float32
  accumulation.
  `tiles` overrides TILES per op ({'gmm': {...}, 'tgmm': {...}}, each may name its
  'family'); tile_m / tile_n set both ops. `platform`: the one the program is built for
  ('cpu', 'gpu', 'tpu'; None: this machine's): the default family, and interpreted on 'cpu'.
  zero_tail=False leaves the output rows past the sum as the kernel leaves them (unspecified,
  possibly non-finite; no [M, N] select to zero them): for an output whose only consumers are
  row-wise and then another gmm of the same sizes, which reads no row past the sum. The input
  gradient's rows past the sum are zero either way."""
  _check_gmm('gmm', lhs_MK, rhs_GKN, group_sizes_G)
  dtype = _check_dtype('gmm', lhs_MK, rhs_GKN)  # mixed dtypes promote, as in ragged_dot
  lhs_MK, rhs_GKN = lhs_MK.astype(dtype), rhs_GKN.astype(dtype)
  with jax.named_scope('gmm'):
    return _gmm(lhs_MK, rhs_GKN, clip_sizes(group_sizes_G, lhs_MK.shape[0]),
                (interpret_flag(interpret, platform),) +
                tiling(target, tile_m, tile_n, tiles, platform, jnp.dtype(dtype).itemsize),
                bool(zero_tail))


def tgmm(lhs_MK, grad_MN, group_sizes_G, *, target: str | None = None, interpret=None,
         tile_m: int | None = None, tile_n: int | None = None, tiles=None,
         platform: str | None = None):
  """Per-group lhs^T @ grad ([G, K, N] float32): the weight gradient of gmm."""
  if lhs_MK.ndim != 2 or grad_MN.ndim != 2 or lhs_MK.shape[0] != grad_MN.shape[0]:
    raise _shape_error('tgmm', f'lhs must be [M, K] and grad [M, N] with the same M, got '
                               f'lhs.shape {lhs_MK.shape} grad.shape {grad_MN.shape}')
  _check_sizes('tgmm', group_sizes_G, None)
  dtype = _check_dtype('tgmm', lhs_MK, grad_MN)
  lhs_MK, grad_MN = lhs_MK.astype(dtype), grad_MN.astype(dtype)
  with jax.named_scope('tgmm'):
    return _tgmm_impl(lhs_MK, grad_MN, clip_sizes(group_sizes_G, lhs_MK.shape[0]),
                      (interpret_flag(interpret, platform),) +
                      tiling(target, tile_m, tile_n, tiles, platform,
                             jnp.dtype(dtype).itemsize))


def gmm_swiglu(x_MD, gate_GDF, up_GDF, group_sizes_G, **kw):
  """silu(x @ gate[g]) * (x @ up[g]) with the gate and up projections fused into one gmm
  (weights concatenated along N, so x is read once). `zero_tail` as in gmm."""
  if gate_GDF.shape != up_GDF.shape:
    raise _shape_error('gmm_swiglu', f'gate and up shapes differ: {gate_GDF.shape} and '
                                     f'{up_GDF.shape}')
  _check_dtype('gmm_swiglu', x_MD, gate_GDF, up_GDF)
  f = gate_GDF.shape[2]
  with jax.named_scope('gate_up'):
    h_MF2 = gmm(x_MD, jnp.concatenate([gate_GDF, up_GDF], axis=2), group_sizes_G, **kw)
  return jax.nn.silu(h_MF2[:, :f]) * h_MF2[:, f:]
