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
`{p}_pallas_E64_over_E8`, plus the Pallas self-check and what `auto` resolves to.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from loopmoe_jax import bench, dispatch

bench.TARGETS.update({'cpu_tiled_E64_over_E8': 1.3, 'cpu_tiled_over_dense': 1.3})


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


def _device(res, quick, platform):
  m, k, n = (4096, 256, 512) if quick else (65536, 2048, 1024)
  res[f'{platform}_pallas_self_check'] = dispatch.pallas_self_check(platform)
  res[f'{platform}_auto'] = dispatch.resolve_backend('auto')
  backends = {'pallas': lambda l, r, s: pallas_kernels.gmm(l, r, s), 'xla': dispatch.gmm_xla}
  for g in (8, 64):
    ops = _operands(m, k, n, g, jnp.bfloat16)
    thunks = {}
    for name, fn in backends.items():
      thunks[f'{name}_fwd_E{g}'] = _fwd(fn, *ops)
      thunks[f'{name}_fwd_bwd_E{g}'] = _fwd_bwd(fn, *ops)
    secs = bench.time_interleaved(thunks, 5 if quick else 20)
    res.update({f'{platform}_s_{key}': v for key, v in secs.items()})
    for kind in ('fwd', 'fwd_bwd'):
      res[f'{platform}_pallas_over_xla_{kind}_E{g}'] = (
          secs[f'pallas_{kind}_E{g}'] / secs[f'xla_{kind}_E{g}'])
  for kind in ('fwd', 'fwd_bwd'):
    res[f'{platform}_pallas_{kind}_E64_over_E8'] = (
        res[f'{platform}_s_pallas_{kind}_E64'] / res[f'{platform}_s_pallas_{kind}_E8'])


@bench.register('kernels')
def bench_kernels(quick: bool = False) -> dict[str, Any]:
  platform = jax.default_backend()
  res: dict[str, Any] = {'quick': quick, 'backend': platform}
  with jax.default_device(jax.devices('cpu')[0]):
    _cpu(res, quick)
  if platform in ('gpu', 'tpu'):
    _device(res, quick, platform)
  return res
