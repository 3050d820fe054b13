"""`kernels` benchmark: grouped matmul backends, ratios measured side by side in one run.

CPU (always; keys start with cpu_):
- cpu_tiled_E64_over_E8: `gmm_tiled` forward at 64 over 8 groups, same rows (16384), K 256,
  N 512 (routing-like ragged sizes); cpu_tiled_fwd_bwd_E64_over_E8 the same for forward +
  backward (both gradients).
- cpu_tiled_over_dense: `gmm_tiled` forward at 64 groups over one dense [M, K] x [K, N]
  matmul of the same FLOPs (cpu_tiled_E8_over_dense and, at tile 64,
  cpu_tiled_tile64_E64_over_dense for information). Tile 128 (gmm_tiled's default).
GPU/TPU (when the default backend is one; keys start with the platform): the Pallas gmm and
ragged_dot forward and forward+backward at E 8 and 64, `{p}_pallas_over_xla_E{E}` and
`{p}_pallas_E64_over_E8`, plus the Pallas self-check and what `auto` resolves to. On a GPU
every tile variant of every kernel family (Triton, Mosaic GPU, warp-specialised Mosaic GPU)
is checked against ragged_dot and timed first. The MoE layer (forward+backward) over a dense
SwiGLU, its error against the xla dispatch, and each Pallas stage's share of its time
(`{p}_moe_stage_share`: route, permute, gate_up, down, combine, each timed alone).
"""
from __future__ import annotations

import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from loopmoe_jax import bench, dispatch, moe
from loopmoe_jax.runtime import HERE, Runtime


def group_sizes(num_rows: int, num_groups: int, seed: int = 0):
  """Ragged sizes summing to num_rows, like a routed batch (multinomial, mild imbalance)."""
  rng = np.random.default_rng(seed)
  probs = rng.dirichlet(np.full(num_groups, 8.0))
  return jnp.asarray(rng.multinomial(num_rows, probs), jnp.int32)


def _operands(m, k, n, g, dtype):
  kl, kr = jax.random.split(jax.random.key(g))
  lhs = jax.random.normal(kl, (m, k), dtype)
  rhs = (jax.random.normal(kr, (g, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  return lhs, rhs, group_sizes(m, g, seed=g)


def _fwd(gmm, lhs, rhs, sizes):
  fn = jax.jit(gmm)
  return lambda: fn(lhs, rhs, sizes)


def _fwd_bwd(gmm, lhs, rhs, sizes):
  loss = lambda l, r: jnp.sum(gmm(l, r, sizes).astype(jnp.float32) ** 2)
  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  return lambda: fn(lhs, rhs)


def _cpu(res, quick):
  m, k, n = (2048, 64, 128) if quick else (16384, 256, 512)
  tile = 128  # the CPU default of gmm_tiled (measured here: 128 beat 32, 64 and 256)
  repeats = 3 if quick else 15
  tiled = lambda l, r, s: dispatch.gmm_tiled(l, r, s, tile)
  tiled64 = lambda l, r, s: dispatch.gmm_tiled(l, r, s, 64)
  ops = {g: _operands(m, k, n, g, jnp.float32) for g in (8, 64)}
  lhs, rhs, _ = ops[8]
  dense = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  thunks = {'dense': lambda: dense(lhs, rhs[0])}
  thunks.update({f'fwd_E{g}': _fwd(tiled, *ops[g]) for g in ops})
  thunks['fwd_E64_tile64'] = _fwd(tiled64, *ops[64])
  secs = bench.time_interleaved(thunks, repeats)
  thunks = {f'fwd_bwd_E{g}': _fwd_bwd(tiled, *ops[g]) for g in ops}
  secs.update(bench.time_interleaved(thunks, max(2, repeats // 2)))
  res.update(cpu_rows=m, cpu_k=k, cpu_n=n, cpu_tile=tile)
  res.update({f'cpu_s_{name}': v for name, v in secs.items()})
  res['cpu_tiled_E64_over_E8'] = secs['fwd_E64'] / secs['fwd_E8']
  res['cpu_tiled_fwd_bwd_E64_over_E8'] = secs['fwd_bwd_E64'] / secs['fwd_bwd_E8']
  res['cpu_tiled_over_dense'] = secs['fwd_E64'] / secs['dense']
  res['cpu_tiled_E8_over_dense'] = secs['fwd_E8'] / secs['dense']
  res['cpu_tiled_tile64_E64_over_dense'] = secs['fwd_E64_tile64'] / secs['dense']


# Device (GPU/TPU) --------------------------------------------------------------------------------

# Kernel families and tile variants tried on a GPU (the first of each list is TILES'
# default). Every variant is checked against ragged_dot before it is timed; the fastest
# correct one per family and op is used for that family's figures, and the family with the
# fastest correct forward+backward at E 64 gives the gpu_pallas_* keys and the MoE layer.
VARIANTS = {
    'gpu': {  # Triton
        'gmm': [dict(tile_m=128, tile_n=128, tile_k=64, num_warps=8, num_stages=3),
                dict(tile_m=128, tile_n=128, tile_k=64, num_warps=4, num_stages=3)],
        'tgmm': [dict(tile_m=64, tile_n=256, tile_k=128, num_warps=8, num_stages=3),
                 dict(tile_m=64, tile_n=128, tile_k=128, num_warps=4, num_stages=3)],
    },
    'mgpu': {  # Mosaic GPU (TMA + wgmma)
        # (dropped after two H200 runs: one CTA per tile, 2 stages, 64-row tiles, XLA-side
        # transposes: 173-236 TFLOP/s against 290-295 for the persistent kernels)
        'gmm': [dict(tile_m=128, tile_n=128, tile_k=64, stages=5, persistent=True),
                dict(tile_m=128, tile_n=128, tile_k=64, stages=4, persistent=True)],
        'tgmm': [dict(tile_m=64, tile_n=128, tile_k=128, stages=4),
                 dict(tile_m=64, tile_n=128, tile_k=128, stages=4, persistent=True)],
    },
    'mgpu_ws': {  # warp-specialised Mosaic GPU (tile_n / tile_k: one warpgroup's share)
        'gmm': [dict(tile_m=128, tile_n=128, tile_k=64, stages=3),
                dict(tile_m=128, tile_n=64, tile_k=64, stages=4),
                dict(tile_m=64, tile_n=128, tile_k=64, stages=4)],
        'tgmm': [dict(tile_m=64, tile_n=128, tile_k=128, stages=3),
                 dict(tile_m=64, tile_n=128, tile_k=64, stages=4),
                 dict(tile_m=128, tile_n=128, tile_k=64, stages=2)],
    },
}
CHECK_TOL = 2e-2  # bf16 inputs, float32 sums: relative to the reference's largest magnitude


def _safe(res, key, fn):
  """Runs fn(); on an exception records its message under `key` (the run goes on)."""
  try:
    return fn()
  except Exception as e:  # pylint: disable=broad-except  (a variant that fails to compile)
    res[key] = f'{type(e).__name__}: {str(e)[:300]}'
    return None


def _block(x):
  return jax.tree.map(lambda a: a.block_until_ready(), x)


def _rel_err(got, want):
  got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
  return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def _tune(res, p, m, k, n, repeats):
  """Checks and times every variant (gmm forward and tgmm at E 64). Returns the candidates
  {name: {op: tiles with their 'family'}}: per family its fastest correct variant of each
  op, and 'mixed' (the fastest gmm and the fastest tgmm of any family) when that differs."""
  lhs, rhs, sizes = _operands(m, k, n, 64, jnp.bfloat16)
  grad = jax.random.normal(jax.random.key(3), (m, n), jnp.bfloat16)
  want = {'gmm': jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32),
          'tgmm': jax.vjp(lambda r: jax.lax.ragged_dot(lhs, r, sizes,
                                                       preferred_element_type=jnp.float32),
                          rhs)[1](grad.astype(jnp.float32))[0]}
  best, fastest = {}, {}
  for family, ops in VARIANTS.items():
    for op, variants in ops.items():
      thunks = {}
      for i, v in enumerate(variants):
        key = f'{p}_tune_{family}_{op}_{i}'
        if op == 'gmm':
          fn = jax.jit(lambda a, b, v=v, f=family: pallas_kernels.gmm(
              a, b, sizes, target=f, tiles={'gmm': v}))
          args = (lhs, rhs)
        else:
          fn = jax.jit(lambda a, b, v=v, f=family: pallas_kernels.tgmm(
              a, b, sizes, target=f, tiles={'tgmm': v}))
          args = (lhs, grad)
        out = _safe(res, f'{key}_error', lambda fn=fn, args=args: _block(fn(*args)))
        if out is None:
          continue
        res[f'{key}_err'] = _rel_err(out, want[op])
        if res[f'{key}_err'] <= CHECK_TOL:
          thunks[i] = lambda fn=fn, args=args: fn(*args)
      secs = bench.time_interleaved(thunks, repeats) if thunks else {}
      for i, sec in secs.items():
        res[f'{p}_tune_{family}_{op}_{i}_tflops'] = 2 * m * k * n / sec / 1e12
      if secs:
        i = min(secs, key=secs.get)
        best.setdefault(family, {})[op] = dict(variants[i], family=family)
        if secs[i] < fastest.get(op, (None, np.inf))[1]:
          fastest[op] = (best[family][op], secs[i])
  for family, tiles in list(best.items()):
    if len(tiles) < 2:  # a family needs a correct gmm and tgmm
      del best[family]
  mixed = {op: tiles for op, (tiles, _) in fastest.items()}
  if len(mixed) == 2 and mixed['gmm']['family'] != mixed['tgmm']['family']:
    best['mixed'] = mixed
  for name, tiles in best.items():
    res[f'{p}_tuned_{name}'] = tiles
  return best


def _gmm_figures(res, p, m, k, n, best, repeats):
  """Each candidate's tuned gmm vs ragged_dot vs a dense matmul of the same FLOPs, forward and
  forward+backward at E 8 and 64 (gradients checked against ragged_dot's at E 64). Returns
  the candidate with the fastest correct forward+backward at E 64 (None if none)."""
  lhs0, rhs0, _ = _operands(m, k, n, 8, jnp.bfloat16)
  dense = lambda l, r, s: jnp.dot(l, r)  # bf16 in and out (float32 sums), bf16 gradients
  thunks = {'dense_fwd': _fwd(dense, lhs0, rhs0[0], None),
            'dense_fwd_bwd': _fwd_bwd(dense, lhs0, rhs0[0], None)}
  backends = {'xla': dispatch.gmm_xla}
  for name, tiles in best.items():
    backends[name] = functools.partial(
        lambda l, r, s, t: pallas_kernels.gmm(l, r, s, tiles=t), t=tiles)
  correct = []
  for g in (8, 64):
    ops = _operands(m, k, n, g, jnp.bfloat16)
    for name, fn in backends.items():
      thunks[f'{name}_fwd_E{g}'] = _fwd(fn, *ops)
      thunks[f'{name}_fwd_bwd_E{g}'] = _fwd_bwd(fn, *ops)
    if g == 64:
      want = thunks['xla_fwd_bwd_E64']()
      for family in best:
        got = _safe(res, f'{p}_{family}_grad_error', thunks[f'{family}_fwd_bwd_E64'])
        if got is None:
          continue
        errs = [_rel_err(a, b) for a, b in zip(got[1], want[1])]
        res[f'{p}_{family}_grad_err_E64'] = max(errs)
        if max(errs) <= CHECK_TOL:
          correct.append(family)
  for family in best:
    if family not in correct:
      for key in [key for key in thunks if key.startswith(family + '_')]:
        del thunks[key]
  secs = bench.time_interleaved(thunks, repeats)
  flops = {'fwd': 2 * m * k * n, 'fwd_bwd': 6 * m * k * n}
  for key, sec in secs.items():
    res[f'{p}_s_{key}'] = sec
    res[f'{p}_tflops_{key}'] = flops[key.split('_', 1)[1].rsplit('_E', 1)[0]] / sec / 1e12
  if not correct:
    return None
  chosen = min(correct, key=lambda f: secs[f'{f}_fwd_bwd_E64'])
  res[f'{p}_pallas_choice'] = chosen
  for kind in ('fwd', 'fwd_bwd'):
    for g in (8, 64):
      mine = secs[f'{chosen}_{kind}_E{g}']
      res[f'{p}_pallas_over_xla_{kind}_E{g}'] = mine / secs[f'xla_{kind}_E{g}']
      res[f'{p}_pallas_over_dense_{kind}_E{g}'] = mine / secs[f'dense_{kind}']
    res[f'{p}_pallas_{kind}_E64_over_E8'] = (secs[f'{chosen}_{kind}_E64']
                                            / secs[f'{chosen}_{kind}_E8'])
  return chosen


# For comparison: XLA sort + gathers around the Pallas gmm, gate and up as two gmm calls.
GMM_ONLY = dispatch._grouped('pallas_gmm_only')  # pylint: disable=protected-access


def _stage_thunks(x, router, experts, top_k, runtime: Runtime):
  """Forward+backward of each stage of the all-Pallas MoE layer on its own (inputs made
  outside the timed call), so their times show where the layer's time goes."""
  pk, mm, rk = pallas_kernels, runtime.kernels, runtime.routing_kernels
  logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))
  plan = jax.jit(lambda l: pk.route(l, top_k, **rk))(logits)
  sizes, pos, wts = plan['counts_E'], plan['positions_Tk'], plan['weights_Tk']
  x_M = jax.jit(lambda a, p: pk.permute(a, p, **rk))(x, pos)
  h_M = jax.jit(lambda a, g, u, s: pk.gmm_swiglu(a, g, u, s, **mm))(
      x_M, experts['gate'], experts['up'], sizes)
  y_M = jax.jit(lambda a, w, s: pk.gmm(a, w, s, **mm))(h_M, experts['down'], sizes)
  square = lambda a: jnp.sum(jnp.asarray(a, jnp.float32) ** 2)
  stages = {
      'route': (lambda l: square(pk.route(l, top_k, **rk)['weights_Tk']), (logits,)),
      'permute': (lambda a: square(pk.permute(a, pos, **rk)), (x,)),
      'gate_up': (lambda a, g, u: square(pk.gmm_swiglu(a, g, u, sizes, **mm)),
                  (x_M, experts['gate'], experts['up'])),
      'down': (lambda a, w: square(pk.gmm(a, w, sizes, **mm)), (h_M, experts['down'])),
      'combine': (lambda a, w: square(pk.combine(a, pos, w, **rk)), (y_M, wts)),
  }
  thunks = {}
  for name, (loss, args) in stages.items():
    step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))
    thunks[f'stage_{name}'] = functools.partial(step, *args)
  return thunks


def _moe_layer(res, p, tokens, d, f, e, top_k, tiles, repeats):
  """MoE layer (router, top-k, dispatch, SwiGLU experts, combine) forward+backward over a
  dense SwiGLU of the same active width (top_k * f) on the same tokens."""
  keys = jax.random.split(jax.random.key(1), 6)
  bf = jnp.bfloat16
  x = jax.random.normal(keys[0], (tokens, d), bf)
  w = lambda key, shape, fan: (jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan)).astype(bf)
  experts = {'gate': w(keys[1], (e, d, f), d), 'up': w(keys[2], (e, d, f), d),
             'down': w(keys[3], (e, f, d), f)}
  router = w(keys[4], (d, e), d)
  dense = {'gate': w(keys[1], (d, top_k * f), d), 'up': w(keys[2], (d, top_k * f), d),
           'down': w(keys[3], (top_k * f, d), top_k * f)}
  runtime = HERE.with_tiles(tiles)  # the dispatch path takes these tiles

  def moe_loss(params, x, backend):
    logits = jnp.dot(x.astype(jnp.float32), params['router'].astype(jnp.float32))
    experts_Tk, weights_Tk, probs_TE, plan = moe.route_for(backend, logits, top_k, True,
                                                           runtime=runtime)
    run = GMM_ONLY if backend == 'pallas_gmm_only' else dispatch.BACKENDS[backend]
    y = run(x, experts_Tk, weights_Tk, params['experts'], plan=plan, runtime=runtime)
    return jnp.sum(y.astype(jnp.float32) ** 2) + moe.load_balance_loss(experts_Tk, probs_TE)

  def dense_loss(params, x):
    h = jax.nn.silu(x @ params['gate']) * (x @ params['up'])
    return jnp.sum((h @ params['down']).astype(jnp.float32) ** 2)

  grad = lambda fn: jax.jit(jax.value_and_grad(fn, argnums=(0, 1)), static_argnums=(2,))
  moe_step, dense_step = grad(moe_loss), jax.jit(jax.value_and_grad(dense_loss, (0, 1)))
  params = {'router': router, 'experts': experts}
  thunks = {'dense': lambda: dense_step(dense, x)}
  for backend in ('pallas', 'pallas_gmm_only', 'xla'):
    thunks[backend] = functools.partial(moe_step, params, x, backend)
  thunks.update(_stage_thunks(x, router, experts, top_k, runtime))
  want = jax.tree.leaves(thunks['xla']())  # loss and gradients: pallas == ragged_dot's
  res[f'{p}_moe_pallas_err'] = max(
      _rel_err(a, b) for a, b in zip(jax.tree.leaves(thunks['pallas']()), want))
  secs = bench.time_interleaved(thunks, repeats)
  res.update({f'{p}_moe_s_{k}': v for k, v in secs.items()})
  res[f'{p}_moe_stage_share'] = {k.split('_', 1)[1]: v / secs['pallas']
                                 for k, v in secs.items() if k.startswith('stage_')}
  res[f'{p}_moe_layer_over_dense_swiglu'] = secs['pallas'] / secs['dense']
  res[f'{p}_moe_layer_gmm_only_over_dense_swiglu'] = secs['pallas_gmm_only'] / secs['dense']
  res[f'{p}_moe_layer_xla_over_dense_swiglu'] = secs['xla'] / secs['dense']
  res[f'{p}_moe_shape'] = dict(tokens=tokens, d=d, f=f, experts=e, top_k=top_k)


def _jax_mgpu_info(res, p, m, k, n, repeats):
  """For information: the Mosaic GPU (wgmma + TMA) ragged dot that ships with jax, forward
  TFLOP/s at E 8 and 64 (what a Hopper-native kernel reaches on this shape)."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # pylint: disable=import-outside-toplevel
  for g in (8, 64):
    lhs, rhs, sizes = _operands(m, k, n, g, jnp.bfloat16)
    fn = jax.jit(functools.partial(
        ragged_dot_mgpu.ragged_dot, group_sizes=sizes, block_m=128, block_n=128, block_k=64,
        max_concurrent_steps=4, grid_block_n=2))
    secs = bench.time_interleaved({'mgpu': lambda: fn(lhs, rhs)}, repeats)['mgpu']
    res[f'{p}_info_jax_mgpu_ragged_dot_tflops_fwd_E{g}'] = 2 * m * k * n / secs / 1e12


def _progress(res):
  """Prints the results so far (one JSON line), so a run cut short still shows them."""
  print('partial results:', json.dumps(res, default=str), flush=True)


def _device(res, quick, platform):
  m, k, n = (4096, 256, 512) if quick else (65536, 2048, 1024)
  repeats = 5 if quick else 20
  res[f'{platform}_device'] = str(jax.devices()[0].device_kind)
  res[f'{platform}_jax'] = jax.__version__
  error = dispatch.pallas_self_check()
  res[f'{platform}_pallas_self_check'] = not error
  if error:
    res[f'{platform}_pallas_self_check_error'] = error
  res[f'{platform}_auto'] = dispatch.resolve_backend(
      'auto', runtime=HERE.replace(pallas_check=error))
  res[f'{platform}_gmm_shape'] = dict(rows=m, k=k, n=n)
  if platform == 'gpu':
    best = _tune(res, platform, m, k, n, repeats)
    _progress(res)
  else:  # TPU: its one family at TILES' defaults
    best = {'tpu': {op: {'family': 'tpu'} for op in ('gmm', 'tgmm')}}
  chosen = _safe(res, f'{platform}_gmm_error',
                 lambda: _gmm_figures(res, platform, m, k, n, best, repeats))
  _progress(res)
  moe_shape = (m // 4, k, n, 64, 4)
  if chosen:
    _safe(res, f'{platform}_moe_error', lambda: _moe_layer(
        res, platform, *moe_shape, best[chosen], max(3, repeats // 2)))
  if platform == 'gpu' and not quick:
    _safe(res, f'{platform}_info_jax_mgpu_error',
          lambda: _jax_mgpu_info(res, platform, m, k, n, repeats))


@bench.register('kernels')
def bench_kernels(quick: bool = False) -> dict[str, Any]:
  platform = jax.default_backend()
  res: dict[str, Any] = {'quick': quick, 'backend': platform}
  with jax.default_device(jax.devices('cpu')[0]):
    _cpu(res, quick)
  if platform in ('gpu', 'tpu'):
    _device(res, quick, platform)
  return res
