"""The looped MoE language model: embed -> prelude -> core x L -> coda -> norm -> head.

The core's C layers run L times through `nn.scan` with `variable_broadcast='params'`, so its
shared weights appear once in the param tree. With untied attention ("Foil") the core owns
one attention set per pass, stacked along a leading `loops` axis, and feeds pass l its slice
as the scanned input; experts and routers stay shared. The KV cache is scanned per pass, so
there is one slot per executed (pass, layer).

`apply` returns (logits_BTV, extras): extras holds the aux losses averaged over every MoE
visit of the unrolled depth ('load_balance', 'z_loss'), the per-visit values under
'per_visit' ({segment: {'load_balance', 'z_loss', 'load', 'dropped'}}; core arrays are [L, C] and
the expert loads [L, C, E]), and with
`return_routing=True` the routing records under 'routing' ({segment: {'experts', 'logits'}}).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from loopmoe_jax import exit as early_exit_lib
from loopmoe_jax import sharding
from loopmoe_jax.attention import Attention, AttentionWeights
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.core_once import core_once
from loopmoe_jax.layers import DTYPES, DenseMLP, RMSNorm, fan_in_init, param
from loopmoe_jax.moe import MoE
from loopmoe_jax.sharding import constrain

ACTIVATION = ('batch', 'length', 'act_embed')  # the residual stream's logical axes

# Variable collections the core's scan shares across passes (the weights, and read-only
# per-layer inputs such as the expert masks of analysis/masking.py) and those it stacks
# per pass (the KV cache, and values sown for probes under 'intermediates').
BROADCAST = ('params', 'routing_mask')
PER_PASS = {'cache': 0, 'intermediates': 0}

_save = jax.checkpoint_policies.save_only_these_names
# run.remat: what the backward keeps of the forward; everything else it recomputes. Every
# layer (prelude, core passes, coda) is rematerialised per layer stack (one core pass), and
# the head and LM loss with it (objective.py). Named checkpoints: 'attn_qkv' (q, k, v after
# RoPE), 'attention' (the attention output, and chunked attention's log-sum-exp), 'router' (router
# logits), 'expert_out' (the combined expert output: named, but no backward reads it, so no
# policy keeps it; the expert FFN's intermediates are recomputed), 'exchange' (the rows each
# expert-parallel all-to-all delivers). Measured memory and recompute per policy: README, scripts/dry_run.py.
REMAT = {
    'full': None,                      # keep each stack's input only
    'dots': jax.checkpoint_policies.checkpoint_dots,
    'dots_no_batch': jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    'pass_input': _save('exchange'),   # each pass's input, and what the exchange delivered
    # chunked attention: no attention forward recomputed (its output and log-sum-exp are
    # kept); xla, cudnn and splash keep q, k, v and the output but rerun their forward
    'attention': _save('exchange', 'attn_qkv', 'attention'),
    'named': _save('exchange', 'attn_qkv', 'attention', 'router', 'expert_out'),
}


def remat(module_cls, c: ModelConfig):
  """`module_cls` rematerialised under run.remat (unchanged with 'none')."""
  if c.remat == 'none':
    return module_cls
  return nn.remat(module_cls, policy=REMAT[c.remat], prevent_cse=False)


class Layer(nn.Module):
  """Pre-norm attention + feed-forward; each write scaled by `scale` (1/r inside SMELT loops)."""
  cfg: ModelConfig
  num_experts: int
  scale: float = 1.0
  decode: bool = False
  record: bool = False

  @nn.compact
  def __call__(self, x_BTD, positions_BT, attn_w=None, bias_E=None):
    c = self.cfg
    if attn_w is None:
      attn_w = AttentionWeights(c, name='attn')()
    norm = lambda name: RMSNorm(c.norm_gain, c.norm_eps, c.param_dtype, name=name)
    h = Attention(c, self.decode, name='attention')(norm('attn_norm')(x_BTD), positions_BT, attn_w)
    x_BTD = x_BTD + self.scale * h
    u = norm('mlp_norm')(x_BTD)
    if self.num_experts:
      h, stats = MoE(c, self.num_experts, self.record, name='moe')(u, bias_E)
    else:
      h, stats = DenseMLP(c.expert_width, c.param_dtype, name='mlp')(u), {}
    return constrain(x_BTD + self.scale * h, ACTIVATION), stats


class Stack(nn.Module):
  """One pass over `num_layers` layers. Attention weights come from the layers themselves, or,
  when `pass_attn` is given (untied core), from it: one weight dict per layer."""
  cfg: ModelConfig
  num_layers: int
  num_experts: int
  scale: float = 1.0
  injection: str = 'none'
  decode: bool = False
  record: bool = False

  @nn.compact
  def __call__(self, x_BTD, pass_attn, e_BTD, positions_BT, bias_CE=None):
    c = self.cfg
    if self.injection == 'add':
      x_BTD = x_BTD + e_BTD
    elif self.injection == 'concat':
      w = param(self, 'inject', (2, c.d_model, c.d_model), ('inject_src', 'embed_in', 'embed'),
                fan_in_init([0, 1], [2]), DTYPES[c.param_dtype]).astype(x_BTD.dtype)
      x_BTD = x_BTD @ w[0] + e_BTD @ w[1]
    stats = []
    for i in range(self.num_layers):
      layer = Layer(c, self.num_experts, self.scale, self.decode, self.record, name=f'layer_{i}')
      x_BTD, s = layer(x_BTD, positions_BT, None if pass_attn is None else pass_attn[i],
                       None if bias_CE is None else bias_CE[i])
      stats.append(s)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *stats) if stats[0] else {}
    return x_BTD, stacked


class Core(nn.Module):
  """D shared layers applied `num_loops` times (default: the trained count). Under a mesh the
  scan runs through `core_once` (collectives once per step, core_once.py) when it applies.

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

  @nn.compact
  def __call__(self, x_BTD, positions_BT, num_loops: int, bias=None, backprop_loops: int = 0,
               readout=None, states: bool = False):
    """`bias`: the core's router bias, [C, E] ('shared') or [trained L, D, E] ('per_pass';
    a forward with more passes than trained reuses the last pass's bias), or None.
    `readout` (exit.Readout): per-token early exit (exit.py); the statistics are then
    {'exit_passes': passes_BT} only. `states` (gate training): the statistics also hold every
    pass's output state under 'pass_states' ([L, B, T, D], exit.scan_core_states)."""
    c = self.cfg
    per_pass = bias is not None and bias.ndim == 3
    if per_pass:
      bias = bias[jnp.minimum(jnp.arange(num_loops), bias.shape[0] - 1)]
    scale = residual_scale(c, num_loops)
    pass_attn = None
    if not c.tie_attention:
      stacked = [AttentionWeights(c, stack=c.num_loops, name=f'pass_attn_{i}')()
                 for i in range(c.core_layers)]
      pass_attn = jax.tree.map(lambda w: w[:num_loops], stacked)
    body = remat(Stack, c)
    kw = dict(cfg=c, num_layers=c.core_layers, num_experts=c.core_experts, scale=scale,
              injection=c.injection, decode=self.decode, record=self.record)
    e_BTD = x_BTD if c.injection != 'none' else None
    # the first pass with gradient (0: all of them)
    split = num_loops - backprop_loops if 0 < backprop_loops < num_loops else 0
    if split and (self.decode or self.is_mutable_collection('intermediates')):
      raise ValueError(f'backprop_loops={backprop_loops} is a training setting: decoding and '
                       'probes run every pass with gradient (backprop_loops=0)')
    if readout is not None:  # early exit: always the scan (an inference setting)
      if split:
        raise ValueError(f'backprop_loops={backprop_loops}: early exit (model.exit) is an '
                         'inference setting; use backprop_loops=0')
      return early_exit_lib.scan_core(body(**kw, name='body'),
                                      (x_BTD, pass_attn, e_BTD, positions_BT, bias), num_loops,
                                      per_pass, readout, BROADCAST, PER_PASS)
    if states and not self.is_initializing():  # gate training: always the scan
      if split or self.decode:
        raise ValueError(f'backprop_loops={backprop_loops}: gate training (model.exit=\'gate\') '
                         'backpropagates through every pass (backprop_loops=0) and does not decode')
      x_BTD, stats, states_LBTD = early_exit_lib.scan_core_states(
          body(**kw, name='body'), (x_BTD, pass_attn, e_BTD, positions_BT, bias), num_loops,
          per_pass, BROADCAST, PER_PASS)
      return x_BTD, dict(stats, pass_states=states_LBTD)
    if c.loop_impl == 'scan' or self.decode:
      scan = lambda length: nn.scan(
          body, variable_broadcast=BROADCAST, variable_axes=PER_PASS,
          split_rngs={'params': False},
          in_axes=(0, nn.broadcast, nn.broadcast, 0 if per_pass else nn.broadcast),
          length=length)
      args = (x_BTD, pass_attn, e_BTD, positions_BT, bias)
      once = self._collectives_once(x_BTD.shape[0])
      if split and not self.is_initializing():
        return self._truncated(scan, kw, args, split, num_loops, per_pass, once)
      if once:
        return core_once(scan(num_loops)(**kw), self.variables['params']['body'], args)
      return scan(num_loops)(**kw, name='body')(*args)
    stack = body(**kw, name='body')
    stats = []
    for l in range(num_loops):
      if split and l == split:
        x_BTD, stats = jax.lax.stop_gradient((x_BTD, stats))
      attn_l = None if pass_attn is None else jax.tree.map(lambda w: w[l], pass_attn)
      x_BTD, s = stack(x_BTD, attn_l, e_BTD, positions_BT, bias[l] if per_pass else bias)
      stats.append(s)
    return x_BTD, jax.tree.map(lambda *a: jnp.stack(a), *stats)

  def _truncated(self, scan, kw, args, split, num_loops, per_pass, once):
    """Passes [0, split), stop_gradient, then passes [split, num_loops): two scans applied to
    the one set of weights under 'body' (each through core_once when `once`), each pass with
    its own slice of the per-pass inputs; the statistics of both parts joined by pass."""
    x_BTD, pass_attn, e_BTD, positions_BT, bias = args
    weights = {col: self.variables[col]['body'] for col in BROADCAST
               if 'body' in self.variables.get(col, {})}
    stats = []
    for lo, hi in ((0, split), (split, num_loops)):
      part = lambda t: None if t is None else jax.tree.map(lambda a: a[lo:hi], t)
      part_args = (x_BTD, part(pass_attn), e_BTD, positions_BT,
                   part(bias) if per_pass else bias)
      scanned = scan(hi - lo)(**kw)
      if once:
        x_BTD, s = core_once(scanned, weights['params'], part_args)
      else:
        x_BTD, s = scanned.apply(weights, *part_args)
      if lo == 0:  # no gradient to the carry, the statistics or the weights of these passes
        x_BTD, s = jax.lax.stop_gradient((x_BTD, s))
      stats.append(s)
    return x_BTD, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *stats)

  def _collectives_once(self, batch: int) -> bool:
    """run.core_collectives='once' applies: a multi-device mesh without `tensor` (heads and
    expert widths would need manual collectives) whose batch shards split the sequences,
    training or evaluation (not decoding, routing records, probes or expert masks), params
    already made. Otherwise the loop runs as a plain scan under XLA's partitioning."""
    mesh = jax.sharding.get_abstract_mesh()
    return (self.cfg.core_collectives == 'once' and not mesh.empty and mesh.size > 1 and
            not sharding.is_manual(mesh) and mesh.shape['tensor'] == 1 and
            batch % sharding.batch_size_of(mesh) == 0 and not self.decode and
            not self.record and not self.is_initializing() and
            'routing_mask' not in self.variables and
            not self.is_mutable_collection('intermediates'))


class LoopedMoE(nn.Module):
  """The language model. Call with int tokens [B, T] (or `x_BTD` embeddings instead)."""
  cfg: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, tokens_BT=None, *, num_loops: int | None = None,
               return_routing: bool = False, x_BTD=None, return_hidden: bool = False,
               backprop_loops: int = 0, early_exit: bool | None = None,
               pass_outputs: bool = False):
    """(logits_BTV float32, extras); with `return_hidden` (hidden_BTD, extras): the final
    normed states, for a loss that applies the head itself (`head_matrix`, objective.py).
    `backprop_loops` = k > 0: gradient through the core's last k passes only (truncated
    backprop, `Core`; a training setting, train.backprop_loops); the forward is unchanged.
    `early_exit`: apply model.exit's per-token early exit (exit.py; default: when decoding);
    extras['exit'] then holds the passes each token ran. `pass_outputs` (gate training,
    model.exit='gate', with `return_hidden`): extras['pass_hidden'] [L, B, T, D], the final
    normed states a token exiting after each pass outputs (exit.pass_outputs; the last is the
    returned one), and extras['pass_lambda'] [L, B, T], the gate's lambda after each pass."""
    c = self.cfg
    dt = DTYPES[c.dtype]
    num_loops = self._check_loops(num_loops)
    pass_outputs = pass_outputs and not self.is_initializing()
    if pass_outputs and (c.exit != 'gate' or not c.core_layers or not return_hidden or
                         early_exit or self.decode):
      raise ValueError("pass_outputs=True is gate training: it needs model.exit='gate', "
                       'model.core_layers >= 1, return_hidden=True and no early_exit')
    exiting = (c.exit != 'none' and c.core_layers > 0 and not self.is_initializing() and
               (self.decode if early_exit is None else early_exit))
    gate = early_exit_lib.gate_params(self, c.d_model, DTYPES[c.param_dtype]) if (
        (exiting or pass_outputs) and c.exit == 'gate') else None  # a missing gate fails here
    if not 0 <= backprop_loops <= num_loops:
      raise ValueError(f'backprop_loops={backprop_loops}: must lie in [0, {num_loops}], the '
                       'passes this forward runs (0: all of them)')
    embed_VD = param(self, 'embed', (c.vocab_size, c.d_model), ('vocab', 'embed'),
                     nn.initializers.normal(1.0), DTYPES[c.param_dtype])
    if x_BTD is None:  # the table gathered whole over its width first (an FSDP parameter
      # gather), so each batch shard looks up its own tokens: no activation is gathered
      x_BTD = jnp.take(constrain(embed_VD, ('vocab', None)), tokens_BT, axis=0)
    x_BTD = constrain(x_BTD.astype(dt), ACTIVATION)
    positions_BT = self._positions(x_BTD.shape[0], x_BTD.shape[1])

    per_visit: dict[str, Any] = {}
    seg_kw = dict(decode=self.decode, record=return_routing)
    bias = {}
    if c.router_bias != 'none':
      if not (self.is_initializing() or self.has_variable(ROUTER_BIAS, 'bias')):
        raise ValueError(f'model.router_bias={c.router_bias!r}: apply needs the trained bias, '
                         f"variables {{'params': ..., '{ROUTER_BIAS}': ...}} (the train state's "
                         f"'{ROUTER_BIAS}', or checkpoint.load_router_bias)")
      bias = self.variable(ROUTER_BIAS, 'bias', lambda: {
          seg: jnp.zeros(shape, jnp.float32) for seg, shape in bias_shapes(c).items()}).value
    stack = remat(Stack, c)  # prelude and coda, rematerialised like the core's passes
    if c.prelude_layers:
      x_BTD, per_visit['prelude'] = stack(c, c.prelude_layers, c.prelude_experts, **seg_kw,
                                          name='prelude')(x_BTD, None, None, positions_BT,
                                                          bias.get('prelude'))
    readout = early_exit_lib.readout(self, embed_VD, gate, head_matrix) if exiting else None
    if c.core_layers:
      x_BTD, per_visit['core'] = Core(c, **seg_kw, name='core')(
          x_BTD, positions_BT, num_loops, bias.get('core'), backprop_loops, readout,
          pass_outputs)
    passes_BT = per_visit.get('core', {}).pop('exit_passes', None)
    states_LBTD = per_visit.get('core', {}).pop('pass_states', None)
    coda = stack(c, c.coda_layers, c.coda_experts, **seg_kw, name='coda') if (
        c.coda_layers) else None
    if coda is not None:
      x_BTD, per_visit['coda'] = coda(x_BTD, None, None, positions_BT, bias.get('coda'))
    final_norm = RMSNorm(c.norm_gain, c.norm_eps, c.param_dtype, name='final_norm')
    x_BTD = final_norm(x_BTD)
    head_DV = None if c.tie_embeddings else param(
        self, 'head', (c.d_model, c.vocab_size), ('embed', 'vocab'), fan_in_init([0], [1]),
        DTYPES[c.param_dtype])
    if c.exit == 'gate' and gate is None:  # made last: the other params' init is unchanged
      early_exit_lib.gate_params(self, c.d_model, DTYPES[c.param_dtype])
    extras = _extras(per_visit, return_routing)
    if passes_BT is not None:
      extras['exit'] = early_exit_lib.extras(passes_BT)
    if states_LBTD is not None:
      n = states_LBTD.shape[0]
      coda_fn = None if coda is None else (lambda h: coda(
          h, None, None, jnp.tile(positions_BT, (n - 1, 1)), bias.get('coda'))[0])
      extras['pass_hidden'] = early_exit_lib.pass_outputs(states_LBTD, x_BTD, coda_fn, final_norm)
      extras['pass_lambda'] = early_exit_lib.pass_lambda(
          early_exit_lib.readout(self, embed_VD, gate, head_matrix), states_LBTD)
    if return_hidden:
      return x_BTD, extras
    logits_BTV = x_BTD @ head_matrix(c, {'embed': embed_VD, 'head': head_DV})
    return logits_BTV.astype(jnp.float32), extras

  def _check_loops(self, num_loops):
    return check_loops(self.cfg, num_loops)

  def _positions(self, batch, length):
    base = jnp.arange(length, dtype=jnp.int32)
    if self.decode:
      initialized = self.has_variable('cache', 'position')
      pos = self.variable('cache', 'position', lambda: jnp.zeros((), jnp.int32))
      base = base + pos.value
      if initialized:
        pos.value = pos.value + length
    return jnp.broadcast_to(base, (batch, length))


def head_matrix(c: ModelConfig, params, dtype=None):
  """The output head [D, V] from the model's params (their 'embed' and 'head'), in `dtype`
  (default the compute dtype): the untied 'head', or the tied embedding table transposed over
  sqrt(d_model) (gathered whole over its width first, the same parameter gather as the
  lookup)."""
  dt = dtype or DTYPES[c.dtype]
  if c.tie_embeddings:
    table_VD = constrain(params['embed'], ('vocab', None))
    return table_VD.T.astype(dt) / jnp.sqrt(c.d_model).astype(dt)
  return params['head'].astype(dt)


def _extras(per_visit, return_routing):
  flat = {name: jnp.concatenate([s[name].reshape(-1) for s in per_visit.values() if s])
          for name in ('load_balance', 'z_loss') if any(per_visit.values())}
  extras = {name: jnp.mean(v) for name, v in flat.items()}
  if not flat:
    extras = {'load_balance': jnp.zeros(()), 'z_loss': jnp.zeros(())}
  extras['dropped'] = sum((jnp.sum(s['dropped']) for s in per_visit.values() if s),
                          jnp.zeros((), jnp.int32))
  extras['per_visit'] = {seg: {n: s[n] for n in ('load_balance', 'z_loss', 'load', 'dropped')}
                         for seg, s in per_visit.items() if s}
  if return_routing:
    extras['routing'] = {seg: {n: s[n] for n in ('experts', 'logits')}
                         for seg, s in per_visit.items() if s}
  return extras


def for_init(model: nn.Module) -> nn.Module:
  """`model` (a LoopedMoE, or any module holding a ModelConfig `cfg`, such as an MoE layer)
  with the settings that are cheapest to trace and change no parameter (dispatch 'xla',
  attention 'xla'): init traces the forward to find the params, and the CPU default
  dispatch ('tiled') or a Pallas kernel traces in about twice the time. Names, shapes, init
  values and the router-bias and cache collections are the same
  (tests/test_model.py::test_init_is_the_same_under_every_dispatch_and_attention)."""
  return model.clone(cfg=model.cfg.replace(dispatch='xla', attention_impl='xla'))


# The variable collection of model.router_bias (not trained): {'bias': {segment: array}}.
ROUTER_BIAS = 'router_bias'


def variables(params, **collections) -> dict:
  """apply's variables: a param tree, or variables that already hold 'params' (a model with a
  router bias, {'params': ..., 'router_bias': ...}, as run.Loaded.variables gives it;
  a param tree's top keys are module names), joined by the other collections given and not
  None (`router_bias=`, analysis/masking's `routing_mask=`)."""
  out = dict(params) if 'params' in params else {'params': params}
  out.update({k: v for k, v in collections.items() if v is not None})
  return out


def bias_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
  """{segment: shape} of the router bias: [layers, E] per MoE segment, the core's
  [L, C, E] with 'per_pass'; {} with model.router_bias='none'."""
  if c.router_bias == 'none':
    return {}
  out = {}
  for seg, layers, experts, passes in c.segments:
    if experts:
      per_pass = seg == 'core' and c.router_bias == 'per_pass'
      out[seg] = (passes, layers, experts) if per_pass else (layers, experts)
  return out


def residual_scale(c: ModelConfig, num_loops: int) -> float:
  """SMELT's 1/r on every write inside the core (`model.residual_scale='inverse_loops'`), with
  r the trained pass count or, with `model.scale_passes='executed'`, the count this forward
  runs (the paper does not fix which: an option, docs/formulas.md, 'SMELT'); 1 otherwise. The
  two agree at the trained count."""
  if c.residual_scale != 'inverse_loops':
    return 1.0
  return 1.0 / (num_loops if c.scale_passes == 'executed' else c.num_loops)


# Test-time recurrence runs at most this many times the trained passes: a count beyond it is
# far past anything the papers evaluate and would run for minutes or hours unannounced.
MAX_LOOPS_FACTOR = 8


def check_loops(c: ModelConfig, num_loops: int | None) -> int:
  """The passes a forward with `num_loops` runs (None: the trained count); a count the
  weights cannot run, or past MAX_LOOPS_FACTOR x the trained one, is a ValueError."""
  if num_loops is None:
    return c.num_loops
  if num_loops < 1:
    raise ValueError(f'num_loops={num_loops}: must be >= 1')
  limit = MAX_LOOPS_FACTOR * c.num_loops
  if num_loops > limit:
    raise ValueError(f'num_loops={num_loops} exceeds the limit of {limit} passes '
                     f'({MAX_LOOPS_FACTOR} x the trained model.num_loops={c.num_loops})')
  if not c.tie_attention and num_loops > c.num_loops:
    raise ValueError(f'num_loops={num_loops} exceeds the trained model.num_loops='
                     f'{c.num_loops}: untied attention has weights for {c.num_loops} passes '
                     'only (test-time recurrence needs model.tie_attention=True)')
  return num_loops
