"""Dropless MoE dispatch behind one small interface.

    dispatch(x_TD, experts_Tk, weights_Tk, params, backend) -> y_TD

`params` holds the SwiGLU experts: gate_EDF, up_EDF, down_EFD. Backends:

- `reference`: slow and obvious. Every expert runs on every token; a token keeps the outputs
  of the experts it chose, weighted. Cost grows with E.
- `tiled`: permute the T*k assignments into expert order (stable sort), run a grouped
  matmul over the ragged groups with `gmm_tiled`, un-permute, combine. The work is
  at most T*k/tile whole tiles plus one remainder chunk per expert, so it stays nearly flat
  in E at fixed T*k (the CPU choice).
- `xla`: the same stages with `jax.lax.ragged_dot` as the grouped matmul (the right choice
  on GPU/TPU; on CPU it computes masked dense work that grows with E).
- `pallas`: every stage a kernel of `pallas_kernels`: permute (row gather), fused gate/up
  gmm, down gmm, combine (weighted gather), all with custom VJPs; it takes the routing
  kernel's counts and positions (`plan`) when the model routes with `pallas_kernels.route`.
  TPU Mosaic, GPU Mosaic GPU / Triton (pallas_kernels.defaults.GPU_DEFAULT; Triton only below
  sm_90, pallas_kernels/capability.py); interpreted on CPU (correct but slow there).
- `dense`: every expert on every token in three whole matmuls, unchosen experts weighted by
  exactly 0 (E/k times the routed work, a handful of ops); what a decode step on the 'tiled'
  backend runs while its tokens are few (`DENSE_MAX_MACS`).
- `auto`: per platform, the backend in FASTEST (see `resolve_backend`).

No capacity limit: no token is ever dropped.

The sorts move rows by permutations (`permute_rows`, `gather_tokens`), whose backward is a
gather by the inverse permutation: a differentiated `x[perm]` would otherwise be a scatter-add
of the whole [rows, D] gradient, which the TPU compiler lowers through extra full-size u32
and mask buffers.
"""
from __future__ import annotations

import concurrent.futures
import functools
from typing import Mapping

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels.metadata import group_bounds

from loopmoe_jax.chunks import in_token_chunks, token_chunks
from loopmoe_jax.gmm_tiled import accumulation_dtype, gmm_tiled
from loopmoe_jax.runtime import Runtime, platform_name


def _swiglu(gate, up):
  return jax.nn.silu(gate) * up


# Tiled grouped matmul -----------------------------------------------------------------------

def gmm_xla(lhs_MK, rhs_GKN, group_sizes_G, tile=None, runtime=None):
  """jax.lax.ragged_dot, accumulating in float32 (float64 for float64 operands)."""
  del tile, runtime
  return jax.lax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32),
                            preferred_element_type=accumulation_dtype(lhs_MK, rhs_GKN)
                            ).astype(lhs_MK.dtype)


# Dispatch backends ----------------------------------------------------------------------------

def dispatch_reference(x_TD, experts_Tk, weights_Tk, params, tile=None, plan=None,
                       runtime=None):
  """Runs every expert on every token and keeps each token's chosen outputs."""
  del tile, plan, runtime
  num_experts = params['gate'].shape[0]
  y_TD = jnp.zeros(x_TD.shape, jnp.float32)
  for e in range(num_experts):
    h = _swiglu(x_TD @ params['gate'][e], x_TD @ params['up'][e])
    out_TD = (h @ params['down'][e]).astype(jnp.float32)
    w_T = jnp.sum(jnp.where(experts_Tk == e, weights_Tk, 0.0), axis=-1)
    y_TD = y_TD + w_T[:, None] * out_TD
  return y_TD.astype(x_TD.dtype)


def dispatch_dense(x_TD, experts_Tk, weights_Tk, params, tile=None, plan=None, runtime=None):
  """Every expert on every row in three products (gate and up batched over the experts,
  down over the experts' widths side by side), each reading its weights as they lie; each
  token's output the sum of its chosen experts' weighted outputs (the others weighted by
  exactly 0): E/k times the routed multiply-adds in a handful of ops, for the few rows of a
  decode step of a model with few experts (DENSE_MAX_MACS, `dispatch`), where the grouped
  backends' sort, tiles and scatters cost more than the rows. Accumulates as the grouped
  matmuls do."""
  del tile, plan, runtime
  e, d, f = params['gate'].shape
  acc = accumulation_dtype(x_TD, params['gate'])
  x_ETD = jnp.broadcast_to(x_TD, (e,) + x_TD.shape)
  # the experts as the products' batch: the weights read where they lie ([E, D, F], no copy)
  up = lambda w: jnp.einsum('etd,edf->etf', x_ETD, w, preferred_element_type=acc).astype(
      x_TD.dtype)
  h_ETF = _swiglu(up(params['gate']), up(params['up']))
  w_TE = jnp.zeros((x_TD.shape[0], e), jnp.float32).at[
      jnp.arange(x_TD.shape[0])[:, None], experts_Tk].add(weights_Tk.astype(jnp.float32))
  h_ETF = (h_ETF.astype(jnp.float32) * w_TE.T[..., None]).astype(x_TD.dtype)
  h_TX = h_ETF.transpose(1, 0, 2).reshape(-1, e * f)  # [E, F, D] is [E * F, D] as it lies
  return jnp.dot(h_TX, params['down'].reshape(e * f, d), preferred_element_type=acc).astype(
      x_TD.dtype)


def inverse_permutation(perm_N):
  """The permutation that undoes `perm_N` ([N] int32): x[perm][inverse] == x."""
  return jnp.zeros_like(perm_N).at[perm_N].set(jnp.arange(perm_N.shape[0], dtype=perm_N.dtype))


@jax.custom_vjp
def permute_rows(x_ND, perm_N, inverse_N):
  """x[perm] for a permutation `perm` of x's rows; the backward gathers the cotangent by
  `inverse_N` (its inverse) instead of scattering it."""
  del inverse_N
  return x_ND[perm_N]


def _permute_rows_fwd(x_ND, perm_N, inverse_N):
  return x_ND[perm_N], inverse_N


def _permute_rows_bwd(inverse_N, g_ND):
  return g_ND[inverse_N], None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_tokens(x_TD, order_M, inverse_M, k: int):
  """x[order // k]: the rows of the M = T*k assignments in the order `order_M` (a permutation
  of the flat [T, k] assignments; `inverse_M` its inverse). The backward gathers the
  cotangent back into assignment order and sums each token's k rows: no scatter."""
  del inverse_M
  return x_TD[order_M // k]


def _gather_tokens_fwd(x_TD, order_M, inverse_M, k):
  return x_TD[order_M // k], inverse_M


def _gather_tokens_bwd(k, inverse_M, g_MD):
  g_TkD = g_MD[inverse_M].reshape(-1, k, g_MD.shape[-1])
  return jnp.sum(g_TkD.astype(jnp.float32), axis=1).astype(g_MD.dtype), None, None


gather_tokens.defvjp(_gather_tokens_fwd, _gather_tokens_bwd)


def gmm_pallas(lhs_MK, rhs_GKN, group_sizes_G, tile=None, *, runtime: Runtime):
  del tile  # the Pallas kernels take the runtime's tiles (pallas_kernels.TILES by default)
  return pallas_kernels.gmm(lhs_MK, rhs_GKN, group_sizes_G, **runtime.kernels)


def sorted_positions(experts_Tk):
  """Where each (token, choice) lands in a stable sort of the flat expert ids, [T, k] int32
  (what the routing kernel returns as positions_Tk)."""
  order = jnp.argsort(experts_Tk.reshape(-1), stable=True)
  return inverse_permutation(order).reshape(experts_Tk.shape).astype(jnp.int32)


def dispatch_pallas(x_TD, experts_Tk, weights_Tk, params, tile=None, plan=None,
                    *, runtime: Runtime):
  """Every stage a Pallas kernel: permute (row gather) -> fused gate/up gmm -> down gmm ->
  combine (weighted gather). `plan` = the routing kernel's counts_E and positions_Tk; without
  it they are computed here from experts_Tk."""
  del tile
  if plan is None:
    num_experts = params['gate'].shape[0]
    plan = {'counts_E': jnp.bincount(experts_Tk.reshape(-1), length=num_experts),
            'positions_Tk': sorted_positions(experts_Tk)}
  counts_E, positions_Tk = plan['counts_E'].astype(jnp.int32), plan['positions_Tk']
  x_MD = pallas_kernels.permute(x_TD, positions_Tk, **runtime.routing_kernels)
  out_MD = grouped_ffn(x_MD, counts_E, params, 'pallas', runtime=runtime)
  return pallas_kernels.combine(out_MD, positions_Tk, weights_Tk, **runtime.routing_kernels)


def _grouped(backend: str):
  def run(x_TD, experts_Tk, weights_Tk, params, tile=64, plan=None, *, runtime: Runtime):
    del plan  # the routing kernel's plan is for 'pallas'; these backends sort here
    num_tokens, k = experts_Tk.shape
    num_experts = params['gate'].shape[0]
    with jax.named_scope('permute'):
      flat_expert = experts_Tk.reshape(-1)
      order = jnp.argsort(flat_expert, stable=True)
      inverse = inverse_permutation(order)
      x_MD = gather_tokens(x_TD, order, inverse, k)
      group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    out_MD = grouped_ffn(x_MD, group_sizes, params, backend, tile, runtime=runtime)
    with jax.named_scope('unpermute'):
      out_TkD = permute_rows(out_MD, inverse, order).reshape(num_tokens, k, -1)
    return combine(out_TkD, weights_Tk).astype(x_TD.dtype)
  return run


def combine(out_TkD, weights_Tk):
  """sum_k weight * expert output, in float32."""
  with jax.named_scope('combine'):
    return jnp.einsum('tkd,tk->td', out_TkD.astype(jnp.float32), weights_Tk.astype(jnp.float32))


def _ffn_reference(x_MD, group_sizes_G, params, tile=None, runtime=None):
  """Every expert on every row, each row keeping its own group's output (slow, obvious)."""
  del tile, runtime
  starts, ends = group_bounds(group_sizes_G.astype(jnp.int32))
  rows = jnp.arange(x_MD.shape[0])
  out = jnp.zeros((x_MD.shape[0], params['down'].shape[-1]), jnp.float32)
  for g in range(params['gate'].shape[0]):
    h = _swiglu(x_MD @ params['gate'][g], x_MD @ params['up'][g]) @ params['down'][g]
    mine = (rows >= starts[g]) & (rows < ends[g])
    out = out + jnp.where(mine[:, None], h.astype(jnp.float32), 0.0)
  return out.astype(x_MD.dtype)


def _ffn_gmm(gmm):
  def ffn(x_MD, group_sizes_G, params, tile, runtime):
    h_MF, down = _hidden_gmm(gmm)(x_MD, group_sizes_G, params, tile, runtime)
    return down(h_MF, params['down'])
  return ffn


def _ffn_pallas(x_MD, group_sizes_G, params, tile=None, *, runtime: Runtime):
  del tile  # h's rows past the sum stay unzeroed: the down gmm reads none of them
  h_MF = pallas_kernels.gmm_swiglu(x_MD, params['gate'], params['up'], group_sizes_G,
                                   zero_tail=False, **runtime.kernels)
  return pallas_kernels.gmm(h_MF, params['down'], group_sizes_G, **runtime.kernels)


def _gmm_tiled(lhs_MK, rhs_GKN, group_sizes_G, tile, runtime):
  del runtime
  return gmm_tiled(lhs_MK, rhs_GKN, group_sizes_G, tile)


FFNS = {'reference': _ffn_reference, 'tiled': _ffn_gmm(_gmm_tiled), 'xla': _ffn_gmm(gmm_xla),
        'pallas': _ffn_pallas,
        'pallas_gmm_only': _ffn_gmm(gmm_pallas)}  # benchmark: gate and up as two gmm calls


def grouped_ffn(x_MD, group_sizes_G, params, backend: str = 'tiled', tile: int = 64,
                *, runtime: Runtime):
  """The experts' SwiGLU on rows sorted by expert: rows [start_g, end_g) through expert g;
  rows past sum(group_sizes) give zeros (jax.lax.ragged_dot semantics). The grouped-matmul
  stage of every backend, and of expert parallelism on each device's local experts; the
  Pallas kernels built as `runtime` says."""
  with jax.named_scope('grouped_matmul'):
    ffn = FFNS[resolve_backend(backend, runtime=runtime)]
    return ffn(x_MD, group_sizes_G.astype(jnp.int32), params, tile, runtime=runtime)


def _hidden_gmm(gmm):
  def hidden(x_MD, group_sizes_G, params, tile, runtime):
    mm = lambda x, w: gmm(x, w, group_sizes_G, tile, runtime=runtime)
    return _swiglu(mm(x_MD, params['gate']), mm(x_MD, params['up'])), mm
  return hidden


def _hidden_pallas(x_MD, group_sizes_G, params, tile=None, *, runtime: Runtime):
  del tile  # rows past the sum zeroed: they are weighted (by 0) before the down gmm
  h_MF = pallas_kernels.gmm_swiglu(x_MD, params['gate'], params['up'], group_sizes_G,
                                   zero_tail=True, **runtime.kernels)
  return h_MF, lambda h, w: pallas_kernels.gmm(h, w, group_sizes_G, **runtime.kernels)


HIDDEN = {'tiled': _hidden_gmm(_gmm_tiled), 'xla': _hidden_gmm(gmm_xla), 'pallas': _hidden_pallas,
          'pallas_gmm_only': _hidden_gmm(gmm_pallas)}


BACKENDS = {
    'reference': dispatch_reference,
    'tiled': _grouped('tiled'),
    'xla': _grouped('xla'),
    'pallas': dispatch_pallas,
    'dense': dispatch_dense,
}
# Decode steps on the 'tiled' backend run `dispatch_dense` when every expert on every token
# takes at most this many multiply-adds (measured here, scripts/benchmark.py decode: the
# grouped path's sort, tile and scatter ops dominate a step of a few rows of small experts)
DENSE_MAX_MACS = 1 << 21

# What `auto` picks per platform. CPU: measured here (scripts/benchmark.py model/kernels on
# 2 CPU cores, jax 0.10.2): 'tiled' stays flat in E, 'xla' (ragged_dot) does masked dense work
# that grows with E, 'pallas' only interprets on CPU. GPU: measured on an H200 (jax 0.11.2,
# scripts/gpu_check.sh): the MoE layer forward+backward at 16384 tokens, top-4 of 64 experts,
# d 2048, F 1024 took 9.1 ms with 'pallas', 475 ms with 'xla'. TPU: 'pallas' not yet measured.
# 'xla' is the fallback when the Pallas self-check fails.
FASTEST = {'cpu': 'tiled', 'gpu': 'pallas', 'tpu': 'pallas'}
FALLBACK = 'xla'


def _self_check_error() -> str | None:
  key_l, key_r = jax.random.split(jax.random.key(0))
  lhs = jax.random.normal(key_l, (256, 128), jnp.bfloat16)
  rhs = jax.random.normal(key_r, (4, 128, 128), jnp.bfloat16)
  sizes = jnp.array([100, 0, 129, 20], jnp.int32)
  got = jax.jit(pallas_kernels.gmm)(lhs, rhs, sizes).astype(jnp.float32)
  want = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
  err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
  return None if err <= 2e-2 else f'relative error {err:.3g} > 2e-2'


def pallas_self_check() -> str:
  """'' when the Pallas gmm matches ragged_dot (bf16 inputs, float32 sums, 2e-2 of the
  largest magnitude) on a small ragged problem on this machine, else why not. Runs in a
  worker thread: JAX's trace state is per thread, so the check executes eagerly even when
  called while a model is being traced."""
  try:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      return pool.submit(_self_check_error).result() or ''
  except Exception as e:  # pylint: disable=broad-except  (a kernel that fails to lower)
    return f'{type(e).__name__}: {str(e)[:500]}'


def _checks_pallas(runtime: Runtime) -> bool:
  """Whether `auto` on this runtime would pick Pallas on this machine (so it is checked)."""
  platform = runtime.target_platform
  return (FASTEST.get(platform) == 'pallas' and
          platform == platform_name(jax.default_backend()))


def settle(runtime: Runtime) -> Runtime:
  """`runtime` with the Pallas self-check's verdict (`Runtime.pallas_check`) where its `auto`
  dispatch would pick Pallas on this machine: checked once, here; every trace reads it."""
  if runtime.pallas_check is not None or not _checks_pallas(runtime):
    return runtime
  return runtime.replace(pallas_check=pallas_self_check())


def resolve_backend(backend: str, *, runtime: Runtime) -> str:
  """'auto' -> the measured-fastest correct backend of the runtime's platform (the fallback
  where the runtime's Pallas self-check failed, or no Pallas family runs on the target GPU:
  aot.kernel_runtime; an unsettled runtime checks now); others unchanged, but 'pallas' where
  that check failed is refused, naming why."""
  if backend == 'pallas' and runtime.pallas_check:
    raise ValueError(f"run.dispatch='pallas': {runtime.pallas_check}; use auto or xla")
  if backend != 'auto':
    return backend
  choice = FASTEST.get(runtime.target_platform, 'tiled')
  if runtime.pallas_check or _checks_pallas(runtime) and settle(runtime).pallas_check:
    return FALLBACK
  return choice


def dispatch(x_TD, experts_Tk, weights_Tk, params: Mapping[str, jax.Array],
             backend: str = 'tiled', tile: int = 64, plan=None, block_rows: int = 0,
             *, runtime: Runtime, decode: bool = False):
  """Applies the chosen experts of every token and combines them with their weights.
  `plan`: the routing kernel's {counts_E, positions_Tk} (used by 'pallas', else ignored).
  `block_rows` r > 0 with more than r routed rows: the tokens run in `token_chunks` (each
  chunk's dispatch, permute to combine, recomputed in its backward: `in_token_chunks`), each
  chunk's routed rows at most r; the same outputs (a token's rows are its own) and bounded
  temporaries, for the chunk's forward rerun in its backward (no extra FLOPs where the remat
  policy keeps the expert output and so skips the MoE in its own recompute: core.REMAT).
  `decode`: a decode step; on the 'tiled' backend dense under DENSE_MAX_MACS."""
  if backend != 'auto' and backend not in BACKENDS:
    raise ValueError(f'run.dispatch={backend!r}: must be one of {sorted(BACKENDS)} or auto')
  t, k = experts_Tk.shape
  name = resolve_backend(backend, runtime=runtime)
  e, d, f = params['gate'].shape
  if decode and name == 'tiled' and 3 * t * e * d * f <= DENSE_MAX_MACS:
    name = 'dense'
  fn = functools.partial(BACKENDS[name], tile=tile, runtime=runtime)
  chunks = token_chunks(t, k, params['gate'].shape[0], 1, block_rows)
  if chunks == 1:
    return fn(x_TD, experts_Tk, weights_Tk, params, plan=plan)
  y_ctD = in_token_chunks(lambda p, x, e, w: fn(x, e, w, p), chunks, params,
                          x_TD, experts_Tk, weights_Tk)
  return y_ctD.reshape(-1, y_ctD.shape[-1])[:t]
