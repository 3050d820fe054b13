"""The MoE feed-forward layer: route (float32) -> dispatch (see dispatch.py) -> combine.
With dispatch 'pallas' the routing runs in the Pallas routing kernel (route_for).

Routing is local: under a device mesh the top-k and its bookkeeping run per batch shard inside
`jax.shard_map` (`route_local`), so no device ever holds the global batch's router
probabilities. The aux losses stay exactly the global batch's: each shard returns its sums
(choices per expert, router probabilities per expert, squared logsumexp), the sums are added
over the shards (an all-reduce of 2E + 1 numbers), and the losses are formed from the totals.
Aux losses per call (one MoE layer on one pass): the Switch load-balance loss
E * sum_i f_i P_i (f_i: share of the T*k choices that went to expert i; P_i: mean router
probability) and the router z-loss mean_t logsumexp(z_t)^2. They are returned, never added
to anything here.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import pallas_kernels
from loopmoe_jax import expert_parallel, sharding
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.dispatch import dispatch, resolve_backend
from loopmoe_jax.layers import DTYPES, DenseMLP, fan_in_init, param
from loopmoe_jax.runtime import HERE, Runtime


def limit_groups(select_TE, top_k: int, max_groups: int, groups: int):
  """DeepSeek-V3's node-limited routing over `groups` contiguous expert groups (devices): a
  group's score is the sum of its ceil(k / M) highest selection scores; the experts outside
  a token's best M = `max_groups` groups get -inf, so its top-k stays within them."""
  t, e = select_TE.shape
  per_TGe = select_TE.reshape(t, groups, e // groups)
  best = min(-(-top_k // max_groups), e // groups)
  score_TG = jnp.sum(jax.lax.top_k(per_TGe, best)[0], axis=-1)
  _, chosen_TM = jax.lax.top_k(score_TG, max_groups)
  allowed_TG = jnp.any(chosen_TM[..., None] == jnp.arange(groups), axis=1)
  return jnp.where(jnp.repeat(allowed_TG, e // groups, axis=1), select_TE, -jnp.inf)


def route(logits_TE, top_k: int, renormalize: bool, bias_E=None, score: str = 'softmax',
          limit: tuple[int, int] = (0, 0)):
  """Top-k of the scores: softmax over all experts, weights renormalised over the k chosen
  (Mixtral) or not; or sigmoid affinities (DeepSeek-V3), weights always normalised over the k.
  `bias_E` (aux-loss-free balancing) is added to the scores for the choice only: the weights
  are the unbiased scores of the chosen experts, and the bias gets no gradient. `limit` (M, G)
  with M > 0: the choice within each token's best M of G expert groups (`limit_groups`)."""
  logits_TE = logits_TE.astype(jnp.float32)
  if score == 'sigmoid':
    probs_TE, renormalize = jax.nn.sigmoid(logits_TE), True
  else:
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
  if bias_E is None and not limit[0]:
    weights_Tk, experts_Tk = jax.lax.top_k(probs_TE, top_k)
  else:
    select_TE = jax.lax.stop_gradient(probs_TE)
    if bias_E is not None:
      select_TE = select_TE + jax.lax.stop_gradient(bias_E)
    if limit[0]:
      select_TE = limit_groups(select_TE, top_k, *limit)
    _, experts_Tk = jax.lax.top_k(select_TE, top_k)
    weights_Tk = jnp.take_along_axis(probs_TE, experts_Tk, axis=-1)
  if renormalize:
    weights_Tk = weights_Tk / jnp.sum(weights_Tk, axis=-1, keepdims=True)
  return experts_Tk, weights_Tk, probs_TE


def route_for(backend: str, logits_TE, top_k: int, renormalize: bool, bias_E=None,
              score: str = 'softmax', limit: tuple[int, int] = (0, 0), *, runtime: Runtime):
  """(experts_Tk, weights_Tk, probs_TE, plan): the 'pallas' dispatch routes with the routing
  kernel (same choices and weights as `route`, plus the per-expert counts and sorted
  positions its permute needs, as `plan`); every other backend, and a device-limited
  routing (`limit`, which the kernel does not do), with `route` (plan None)."""
  if resolve_backend(backend, runtime=runtime) != 'pallas' or limit[0]:
    return (*route(logits_TE, top_k, renormalize, bias_E, score, limit), None)
  if bias_E is not None:
    bias_E = jax.lax.stop_gradient(bias_E)
  r = pallas_kernels.route(logits_TE.astype(jnp.float32), top_k,
                           renormalize=renormalize or score == 'sigmoid', bias_E=bias_E,
                           score=score, **runtime.routing_kernels)
  plan = {'counts_E': r['counts_E'], 'positions_Tk': r['positions_Tk']}
  return r['experts_Tk'], r['weights_Tk'], r['scores_TE'], plan


def expert_load(experts_Tk, num_experts: int):
  """Number of the T*k choices that went to each expert, [E] float32."""
  return jnp.zeros((num_experts,), jnp.float32).at[experts_Tk.reshape(-1)].add(1.0)


def max_vio(load):
  """MaxVio = (max_i load_i - mean load) / mean load over the last (expert) axis; numpy or
  jax arrays (the train step's routing records and analysis/diagnostics.py)."""
  mean = load.mean(-1)
  return (load.max(-1) - mean) / mean


SUM_KEYS = ('load', 'probs', 'z', 'tokens')  # routing_sums' keys


def routing_sums(experts_Tk, probs_TE, logits_TE):
  """The additive statistics of a set of tokens that the aux losses are made of:
  {'load': choices per expert [E], 'probs': router probabilities summed over tokens [E],
  'z': sum over tokens of logsumexp(z_t)^2 [], 'tokens': T []}. Sums over disjoint token
  sets add up to the sums of their union."""
  return {'load': expert_load(experts_Tk, probs_TE.shape[-1]),
          'probs': jnp.sum(probs_TE, axis=0),
          'z': jnp.sum(jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1) ** 2),
          'tokens': jnp.asarray(probs_TE.shape[0], jnp.float32)}


def losses_from_sums(sums, top_k: int):
  """(load-balance loss E * sum_i f_i P_i, z-loss) from `routing_sums` totals (leading axes,
  e.g. [passes, layers], carried through)."""
  num_experts = sums['probs'].shape[-1]
  tokens = sums['tokens'][..., None]
  f_E = sums['load'] / (tokens * top_k)
  p_E = sums['probs'] / tokens
  return num_experts * jnp.sum(f_E * p_E, axis=-1), sums['z'] / sums['tokens']


def load_balance_loss(experts_Tk, probs_TE):
  sums = routing_sums(experts_Tk, probs_TE, jnp.zeros_like(probs_TE))
  return losses_from_sums(sums, experts_Tk.shape[-1])[0]


def z_loss(logits_TE):
  return jnp.mean(jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1) ** 2)


def route_local(logits_TE, cfg: ModelConfig, bias_E=None, *, runtime: Runtime):
  """(experts_Tk, weights_Tk, routing_sums totals, plan) of `route_for`, computed where the
  tokens are: under a device mesh inside `jax.shard_map` over the batch axes (each shard
  routes its own rows; only the per-shard sums leave the shard, stacked [shards, ...] and
  added outside, which keeps them differentiable without a psum in the shard_map). The
  Pallas routing plan is returned on one device only (expert parallelism makes its own)."""
  runtime = runtime.resolved()

  def one_shard(logits_TE, bias_E):
    experts_Tk, weights_Tk, probs_TE, plan = route_for(
        runtime.run.dispatch, logits_TE, cfg.top_k, cfg.renormalize, bias_E, cfg.router_score,
        (cfg.max_expert_devices, cfg.expert_devices), runtime=runtime)
    if cfg.router_score == 'sigmoid':  # the load-balance loss's P_i: per-token shares
      probs_TE = probs_TE / jnp.sum(probs_TE, axis=-1, keepdims=True)
    return experts_Tk, weights_Tk, routing_sums(experts_Tk, probs_TE, logits_TE), plan

  if not runtime.sharded:  # one device, or already local
    return one_shard(logits_TE, bias_E)
  rows = P(sharding.batch_axes(runtime.mesh))
  stacked = {k: rows for k in SUM_KEYS}
  body = lambda l, b: (lambda e, w, s, _: (e, w, jax.tree.map(lambda v: v[None], s)))(
      *one_shard(l, b))
  experts_Tk, weights_Tk, sums = jax.shard_map(
      body, in_specs=(rows, P()), out_specs=(rows, rows, stacked), check_vma=False)(
          logits_TE, bias_E)
  return experts_Tk, weights_Tk, jax.tree.map(lambda v: jnp.sum(v, axis=0), sums), None


class MoE(nn.Module):
  """Routed SwiGLU experts (plus optional always-on shared experts); dropless unless
  `capacity_factor` is set. Under a device mesh (`jax.set_mesh`) the experts run
  expert-parallel (expert_parallel.py); stats['dropped'] counts dropped assignments."""
  cfg: ModelConfig
  num_experts: int
  record: bool = False
  runtime: Runtime = HERE
  decode: bool = False   # a decode step's few rows (dispatch.dispatch's `decode`)

  @nn.compact
  def __call__(self, x_BTD, bias_E=None):
    """`bias_E` [E]: the router bias of model.router_bias (selection only), or None."""
    c, dt = self.cfg, DTYPES[self.cfg.param_dtype]
    b, t, d = x_BTD.shape
    e, f = self.num_experts, c.expert_width
    rt = self.runtime.resolved()
    # declared whole; inside the core's shard_map (core_once.py) a device's view of them
    # holds its own E/n experts (layers.param)
    router_DE = param(self, 'router', (d, e), ('embed', 'experts'), fan_in_init([0], [1]), dt, rt)
    experts = {
        'gate': param(self, 'gate', (e, d, f), ('experts', 'embed', 'mlp'),
                      fan_in_init([1], [2], [0]), dt, rt),
        'up': param(self, 'up', (e, d, f), ('experts', 'embed', 'mlp'),
                    fan_in_init([1], [2], [0]), dt, rt),
        'down': param(self, 'down', (e, f, d), ('experts', 'mlp', 'embed'),
                      fan_in_init([1], [2], [0]), dt, rt),
    }
    x_TD = x_BTD.reshape(b * t, d)
    with jax.named_scope('route'):
      logits_TE = jnp.dot(x_TD.astype(jnp.float32), router_DE.astype(jnp.float32))
      if self.has_variable('routing_mask', 'logit_bias'):  # analysis/masking.py: [E], 0 or -1e9
        mask_E = self.get_variable('routing_mask', 'logit_bias').astype(jnp.float32)
        # on the logits (the masked expert's score is 0) and on the selection bias, so that a
        # router bias (model.router_bias) cannot pick a masked expert back
        logits_TE = logits_TE + mask_E
        bias_E = mask_E if bias_E is None else bias_E + mask_E
      logits_TE = checkpoint_name(logits_TE, 'router')
      experts_Tk, weights_Tk, sums, plan = route_local(logits_TE, c, bias_E, runtime=rt)
    lb, zl = losses_from_sums(sums, c.top_k)
    stats = {'load_balance': lb, 'z_loss': zl, 'load': sums['load']}
    if rt.local:  # inside the core's shard_map: the shard's sums, which the
      stats['sums'] = sums        # core adds over the shards (the losses above are local)
    if self.record:
      stats['experts'] = experts_Tk.reshape(b, t, -1)
      stats['logits'] = logits_TE.reshape(b, t, -1)
    params = {k: v.astype(x_BTD.dtype) for k, v in experts.items()}
    if rt.local:  # inside the core's shard_map: this device's rows and experts
      y_TD, stats['dropped'] = expert_parallel.local_dispatch(x_TD, experts_Tk, weights_Tk,
                                                              params, c, rt.mesh, e, runtime=rt)
    elif rt.sharded:  # under a device mesh: expert parallelism
      y_TD, stats['dropped'] = expert_parallel.moe_dispatch(x_TD, experts_Tk, weights_Tk,
                                                            params, c, rt.mesh, runtime=rt)
    else:
      weights_Tk, _, stats['dropped'] = expert_parallel.apply_capacity(
          experts_Tk, weights_Tk, e, c.capacity_factor)
      y_TD = dispatch(x_TD, experts_Tk, weights_Tk, params, rt.run.dispatch,
                      rt.run.dispatch_tile, plan, rt.run.ffn_block_rows, runtime=rt,
                      decode=self.decode)
    y_BTD = checkpoint_name(y_TD, 'expert_out').reshape(b, t, d)
    if c.num_shared_experts:
      y_BTD = y_BTD + DenseMLP(c.num_shared_experts * c.shared_width, c.param_dtype,
                               name='shared')(x_BTD)
    return y_BTD, stats
