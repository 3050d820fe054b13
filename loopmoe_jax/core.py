"""The looped core and its layers: C shared layers (`Stack`) run L times (`Core`).

The core's C layers run L times through `nn.scan` with `variable_broadcast` over BROADCAST
('params' among them), so its shared weights appear once in the param tree. With untied
attention ("Foil") the core owns one attention set per pass, stacked along a leading `loops`
axis, and feeds pass l its slice as the scanned input; experts and routers stay shared. The
KV cache is scanned per pass (PER_PASS), so there is one slot per executed (pass, layer);
decoding carries it through the passes whole, each pass writing its slot in place
(CorePlan.carry_cache).
Every scan of the passes (the plain forward, truncated backprop's two parts, early exit's and
gate training's, early_exit.py) is made by `scan_passes`; a decode step under early exit
runs its passes in a loop of its own (early_exit._decode_passes).
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from loopmoe_jax import early_exit as early_exit_lib
from loopmoe_jax.attention import Attention, AttentionWeights
from loopmoe_jax.config import LAYERWISE_REMAT, ModelConfig
from loopmoe_jax import core_once as core_once_lib
from loopmoe_jax.core_plan import CoreInputs, CoreOutputs, CorePlan, CoreRequest, Path
from loopmoe_jax.layers import DTYPES, DenseMLP, RMSNorm, fan_in_init, param
from loopmoe_jax.moe import MoE
from loopmoe_jax.runtime import HERE, Runtime

ACTIVATION = ('batch', 'length', 'act_embed')  # the residual stream's logical axes

# Variable collections the core's scan shares across passes (the weights, and read-only
# per-layer inputs such as the expert masks of analysis/masking.py) and those it stacks
# per pass (the KV cache at init, and values sown for probes under 'intermediates'; a
# decode scan carries the cache instead, the stacked slots or a shared layout's one slot:
# CorePlan.carry_cache).
BROADCAST = ('params', 'routing_mask')
PER_PASS = {'cache': 0, 'intermediates': 0}


def scan_passes(fn, length: int, per_pass: bool, carry_cache: bool = False):
  """`fn` (a Stack class, or a function of (module, carry, pass_attn, e_BTD, positions_BT,
  bias)) scanned over `length` passes: BROADCAST shared, PER_PASS stacked per pass, the
  untied attention slices (and a per-pass router bias when `per_pass`) scanned, the injected
  input and the positions broadcast. With `carry_cache` (decoding: CorePlan.carry_cache) the
  KV cache is the scan's carry, whole, and `fn` takes one more scanned input, the pass index
  (CorePlan.pass_indices), so each pass writes its slot in place."""
  in_axes = (0, nn.broadcast, nn.broadcast, 0 if per_pass else nn.broadcast)
  return nn.scan(fn, variable_broadcast=BROADCAST,
                 variable_axes={k: v for k, v in PER_PASS.items()
                                if not (carry_cache and k == 'cache')},
                 variable_carry='cache' if carry_cache else False, split_rngs={'params': False},
                 in_axes=in_axes + ((0,) if carry_cache else ()), length=length)


_save = jax.checkpoint_policies.save_only_these_names
# run.remat: what the backward keeps of the forward; everything else it recomputes. Every
# layer (prelude, core passes, coda) is rematerialised per layer stack (one core pass), and
# the head and LM loss with it (objective.py); 'full' and 'full_keep_exchange' per layer
# (`remat`): their recompute needs no layer's output, so no MoE's return all-to-all and combine
# is replayed. Named checkpoints: 'attn_qkv' (q, k, v after RoPE), 'attention' (the attention
# output, and chunked attention's log-sum-exp), 'router' (router logits), 'expert_out' (the
# combined expert output, [tokens, d_model]), 'exchange' (the rows each expert-parallel
# all-to-all delivers). Under full, pass_input and attention the MoE's dispatch runs in token
# chunks each recomputed in its own backward (run.expert_block_rows, chunks.in_token_chunks);
# full, and the policies that keep 'expert_out', then recompute no MoE forward for the layer's
# or stack's recompute (the chunks' backward reruns theirs), and a chunk's inner values
# ('exchange' among them) are the chunk's own. Measured memory and recompute per policy:
# docs/results.md, scripts/dry_run.py.
REMAT = {
    'full': None,                      # keep each layer's input only
    # full's recompute, but the rows each exchange delivered are kept: no backward replays
    # an expert-parallel all-to-all (SMELT on v5p-128: docs/results.md, issue 52, fifth part)
    'full_keep_exchange': _save('exchange'),
    'dots': jax.checkpoint_policies.checkpoint_dots,
    'dots_no_batch': jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    # each pass's input, the expert outputs, and what an unchunked exchange delivered
    'pass_input': _save('exchange', 'expert_out'),
    # chunked attention: no attention forward recomputed (its output and log-sum-exp are
    # kept); xla, cudnn and splash keep q, k, v and the output but rerun their forward
    'attention': _save('exchange', 'expert_out', 'attn_qkv', 'attention'),
    'named': _save('exchange', 'attn_qkv', 'attention', 'router', 'expert_out'),
}


def remat(module_cls, policy: str):
  """`module_cls` rematerialised under `policy` (run.remat; unchanged with 'none'). A Stack
  under 'full' or 'full_keep_exchange' rematerialises each of its layers instead (one
  checkpoint a layer: the backward keeps every layer's input, and a layer's recompute stops at
  its MoE's expert outputs, where a stack's replays every layer's return exchange but the
  last's; SMELT on v5p-128: docs/results.md, issue 52, fourth and fifth parts)."""
  if policy == 'none':
    return module_cls
  if policy in LAYERWISE_REMAT and module_cls is Stack:
    return functools.partial(Stack, layer_remat=policy)
  return nn.remat(module_cls, policy=REMAT[policy], prevent_cse=False)


class Layer(nn.Module):
  """Pre-norm attention + feed-forward; each write scaled by `scale` (1/r inside SMELT loops)."""
  cfg: ModelConfig
  num_experts: int
  scale: float = 1.0
  decode: bool = False
  record: bool = False
  runtime: Runtime = HERE
  probe: bool = False       # sow the attention's probes (attention.Attention)

  @nn.compact
  def __call__(self, x_BTD, positions_BT, attn_w=None, bias_E=None, pass_index=None):
    c = self.cfg
    if attn_w is None:
      attn_w = AttentionWeights(c, name='attn')()
    norm = lambda name: RMSNorm(c.norm_gain, c.norm_eps, c.param_dtype, name=name)
    attention = Attention(c, self.decode, self.runtime, self.probe, name='attention')
    h = attention(norm('attn_norm')(x_BTD), positions_BT, attn_w, pass_index)
    x_BTD = x_BTD + self.scale * h
    u = norm('mlp_norm')(x_BTD)
    if self.num_experts:
      h, stats = MoE(c, self.num_experts, self.record, self.runtime, self.decode,
                     name='moe')(u, bias_E)
    else:
      h, stats = DenseMLP(c.expert_width, c.param_dtype, name='mlp')(u), {}
    return self.runtime.constrain(x_BTD + self.scale * h, ACTIVATION), stats


class Stack(nn.Module):
  """One pass over `num_layers` layers. Attention weights come from the layers themselves, or,
  when `pass_attn` is given (untied core), from it: one weight dict per layer. `layer_remat`:
  the policy each layer is rematerialised under on its own (run.remat 'full' and
  'full_keep_exchange', `remat`); '' none. `pass_index`: the pass, where a decode scan
  carries every pass's cache slots (the layers' attention writes and reads that pass's)."""
  cfg: ModelConfig
  num_layers: int
  num_experts: int
  scale: float = 1.0
  injection: str = 'none'
  decode: bool = False
  record: bool = False
  runtime: Runtime = HERE
  probe: bool = False
  layer_remat: str = ''

  @nn.compact
  def __call__(self, x_BTD, pass_attn, e_BTD, positions_BT, bias_CE=None, pass_index=None):
    c = self.cfg
    if self.injection == 'add':
      x_BTD = x_BTD + e_BTD
    elif self.injection == 'concat':
      w = param(self, 'inject', (2, c.d_model, c.d_model), ('inject_src', 'embed_in', 'embed'),
                fan_in_init([0, 1], [2]), DTYPES[c.param_dtype]).astype(x_BTD.dtype)
      x_BTD = x_BTD @ w[0] + e_BTD @ w[1]
    stats = []
    for i in range(self.num_layers):
      cls = (nn.remat(Layer, policy=REMAT[self.layer_remat], prevent_cse=False)
             if self.layer_remat else Layer)
      layer = cls(c, self.num_experts, self.scale, self.decode, self.record, self.runtime,
                  self.probe, name=f'layer_{i}')
      x_BTD, s = layer(x_BTD, positions_BT, None if pass_attn is None else pass_attn[i],
                       None if bias_CE is None else bias_CE[i], pass_index)
      stats.append(s)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *stats) if stats[0] else {}
    return x_BTD, stacked


class Core(nn.Module):
  """C shared layers (model.core_layers) applied `num_loops` times (default: the trained
  count). How the passes run is the runtime's decision (`Runtime.core_path`: one scan, the
  scan inside core_once's shard_map with its collectives once per step, or a Python loop);
  early exit and gate training have scans of their own.

  With `backprop_loops` = k (0 < k < num_loops) the backward is truncated (Huginn's truncated
  backprop, Geiping et al. 2025, "Scaling up test-time compute with latent reasoning"): the
  first n - k passes run as one scan, their carry and statistics pass through
  `jax.lax.stop_gradient`, and the last k run as a second scan over the same weights, so
  neither the carry nor any parameter gets gradient from the early passes (and the backward
  keeps nothing of them); the forward values are those of one scan of n passes. Pass l keeps
  its own per-pass router bias and untied attention slice in either part. The prelude's
  output reaches the last k passes through the input injection only (model.injection, as in
  Huginn): without one the prelude gets no gradient through the core."""
  cfg: ModelConfig
  decode: bool = False
  record: bool = False
  runtime: Runtime = HERE
  probe: bool = False

  @nn.compact
  def __call__(self, x_BTD, positions_BT, num_loops: int, bias=None,
               request: CoreRequest = CoreRequest()) -> CoreOutputs:
    """`bias`: the core's router bias, [C, E] ('shared') or [trained L, C, E] ('per_pass';
    a forward with more passes than trained reuses the last pass's bias), or None.
    `request` (core_plan.CoreRequest): truncated backprop, early exit or gate training's
    per-pass states."""
    c = self.cfg
    per_pass = bias is not None and bias.ndim == 3
    if per_pass:
      bias = bias[jnp.minimum(jnp.arange(num_loops), bias.shape[0] - 1)]
    pass_attn = None
    if not c.tie_attention:
      stacked = [AttentionWeights(c, stack=c.num_loops, name=f'pass_attn_{i}')()
                 for i in range(c.core_layers)]
      pass_attn = jax.tree.map(lambda w: w[:num_loops], stacked)
    rt = self.runtime.resolved()  # inside core_once's shard_map: each device's share
    plan = self.plan(rt, num_loops, per_pass, request, x_BTD.shape[0])
    stack = remat(Stack, rt.run.remat)(
        cfg=c, num_layers=c.core_layers, num_experts=c.core_experts,
        scale=residual_scale(c, num_loops), injection=c.injection, decode=self.decode,
        record=self.record, runtime=rt.local_view() if plan.path == Path.ONCE else rt,
        probe=self.probe, name='body')
    inputs = CoreInputs(x_BTD, pass_attn, x_BTD if c.injection != 'none' else None,
                        positions_BT, bias)
    passes = lambda fn, length=num_loops: scan_passes(fn, length, per_pass, plan.carry_cache)
    if plan.path == Path.EARLY_EXIT:
      return early_exit_lib.scan_core(passes, stack, inputs, request.readout, plan)
    if plan.path == Path.PASS_STATES:
      return _with_pass_states(passes, stack, inputs)
    if plan.path == Path.UNROLL:
      return _unrolled(stack, inputs, plan)
    return _scanned(passes, stack, inputs, plan)

  def plan(self, rt: Runtime, num_loops: int, per_pass: bool, request: CoreRequest,
           batch: int) -> CorePlan:
    """The forward's plan: early exit when a readout is given, gate training's scan when
    pass states are asked, else the runtime's `core_path` (once, scan or unroll); truncated
    backprop splits the passes (two scans, or one loop unrolled). Each refusal names the
    setting."""
    k = request.backprop_loops
    split = num_loops - k if 0 < k < num_loops else 0  # the first pass with gradient
    if split and (self.decode or self.probe):
      raise ValueError(f'backprop_loops={k} is a training setting: decoding and probes run '
                       'every pass with gradient (backprop_loops=0)')
    if request.readout is not None:  # early exit (an inference setting): early_exit.scan_core
      if split:
        raise ValueError(f'backprop_loops={k}: early exit (model.exit) is an inference '
                         'setting; use backprop_loops=0')
      path = Path.EARLY_EXIT
    elif request.pass_states:  # gate training: always the scan
      if split or self.decode:
        raise ValueError(f'backprop_loops={k}: gate training (model.exit=\'gate\') '
                         'backpropagates through every pass (backprop_loops=0) and does not decode')
      path = Path.PASS_STATES
    else:
      path = rt.core_path(batch, decode=self.decode, record=self.record, probe=self.probe,
                          initializing=self.is_initializing())
    carry = self.decode and not self.is_initializing()  # init makes the stacked slots
    return CorePlan(path, num_loops, split, per_pass, carry_cache=carry)


def _scanned(passes, stack, inputs: CoreInputs, plan: CorePlan) -> CoreOutputs:
  """The passes as scans of the one bound `stack` (shared weights), through core_once on the
  ONCE path: one scan, or with a split (truncated backprop, Core's docstring) a scan of the
  passes without gradient, whose carry and statistics pass through stop_gradient, then a
  scan of the rest, each with its slices of the per-pass inputs; the statistics of both parts
  joined by pass."""
  run = lambda mdl, *a: mdl(*a)
  once = plan.path == Path.ONCE
  assert not (once and plan.carry_cache), 'decoding never takes the ONCE path'
  layouts = core_once_lib.layouts(stack, inputs, plan.per_pass) if once else None  # both parts'
  x_BTD, stats = inputs.x_BTD, []
  for part in plan.parts:
    part_inputs = inputs._replace(x_BTD=x_BTD)
    if plan.split:
      part_inputs = part_inputs.passes(part, plan.per_pass)
    scan = passes(run, length=part.stop - part.start)
    x_BTD, s = (core_once_lib.core_once(scan, stack, part_inputs, BROADCAST, layouts) if once
                else scan(stack, *part_inputs, *plan.pass_indices(part)))
    if plan.split and part.start == 0:  # no gradient to the carry, the statistics or weights
      x_BTD, s = jax.lax.stop_gradient((x_BTD, s))
    stats.append(s)
  if len(stats) == 1:
    return CoreOutputs(x_BTD, stats[0])
  return CoreOutputs(x_BTD, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *stats))


def _with_pass_states(passes, stack, inputs: CoreInputs) -> CoreOutputs:
  """Gate training's scan: every pass also emits its output state ([L, B, T, D])."""
  def with_state(mdl, x, *a):
    y, s = mdl(x, *a)
    return y, (s, y)
  x_BTD, (stats, states_LBTD) = passes(with_state)(stack, *inputs)
  return CoreOutputs(x_BTD, stats, pass_states_LBTD=states_LBTD)


def _unrolled(stack, inputs: CoreInputs, plan: CorePlan) -> CoreOutputs:
  """model.loop_impl='unroll': a Python loop over the passes on the one `stack` (shared
  weights); passes before the plan's split without gradient."""
  x_BTD, stats = inputs.x_BTD, []
  for l in range(plan.num_loops):
    if plan.split and l == plan.split:
      x_BTD, stats = jax.lax.stop_gradient((x_BTD, stats))
    x_BTD, s = stack(*inputs.one_pass(l, plan.per_pass)._replace(x_BTD=x_BTD))
    stats.append(s)
  return CoreOutputs(x_BTD, jax.tree.map(lambda *a: jnp.stack(a), *stats))


def residual_scale(c: ModelConfig, num_loops: int) -> float:
  """SMELT's 1/r on every write inside the core (`model.residual_scale='inverse_loops'`), with
  r the trained pass count or, with `model.scale_passes='executed'`, the count this forward
  runs (the paper does not fix which: an option, docs/formulas.md, 'SMELT'); 1 otherwise. The
  two agree at the trained count."""
  if c.residual_scale != 'inverse_loops':
    return 1.0
  return 1.0 / (num_loops if c.scale_passes == 'executed' else c.num_loops)


