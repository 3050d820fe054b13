"""The looped MoE language model: embed -> prelude -> core x L -> coda -> norm -> head.

The looped core and its layers are core.py's (`Core`, `Stack`, `Layer`, the remat policies).
Each entry point of `LoopedMoE` returns its output and `extras`: the aux losses averaged
over every MoE visit of the unrolled depth ('load_balance', 'z_loss'), the dropped
assignments ('dropped'), the per-visit values under 'per_visit' ({segment: {'load_balance',
'z_loss', 'load', 'dropped'}}; core arrays are [L, C] and the expert loads [L, C, E]), with
`return_routing=True` the routing records under 'routing' ({segment: {'experts', 'logits'}})
and with early exit the passes each token ran under 'exit'.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from loopmoe_jax import dispatch, early_exit as early_exit_lib
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.core import ACTIVATION, Core, Stack, remat
from loopmoe_jax.core_plan import CoreRequest
from loopmoe_jax.layers import DTYPES, RMSNorm, fan_in_init, param
from loopmoe_jax.runtime import HERE, Runtime


@flax.struct.dataclass
class PassOutputs:
  """Gate training's per-pass readouts (model.exit='gate', `LoopedMoE.gate_outputs`):
  `hidden_LBTD`, the final normed states a token exiting after each pass outputs
  (early_exit.pass_outputs; the last is the full forward's), and `lambda_LBT`, the gate's exit
  probability after each pass."""
  hidden_LBTD: jax.Array
  lambda_LBT: jax.Array


class Want(NamedTuple):
  """What an entry point wants of the one forward (`LoopedMoE._forward`) besides logits: the
  final states (`hidden`), gate training's per-pass outputs (`pass_outputs`), the routing
  records, per-token early exit (None: when decoding) and truncated backprop through the
  core's last `backprop_loops` passes (0: all)."""
  hidden: bool = False
  pass_outputs: bool = False
  routing: bool = False
  early_exit: bool | None = None
  backprop_loops: int = 0


class LoopedMoE(nn.Module):
  """The language model. Its entry points, each with one return type (`model.apply(variables,
  ..., method=...)`; `extras` as the module docstring says):

    __call__(tokens_BT)          scoring and decoding: (logits_BTV float32, extras);
                                 `early_exit` applies model.exit's per-token early exit
                                 (early_exit.py; default: when decoding), extras['exit'] then holds
                                 the passes each token ran; `return_routing` adds the routing
                                 records
    hidden(tokens_BT)            training: (final normed states h_BTD, extras), for a loss that
                                 applies the head itself (`head_matrix`, objective.py);
                                 `backprop_loops` = k > 0: gradient through the core's last k
                                 passes only (truncated backprop, `Core`; the forward is
                                 unchanged)
    gate_outputs(tokens_BT)      gate training (model.exit='gate'): (PassOutputs, extras)
    from_embeddings(x_BTD)       (logits_BTV, extras) from input embeddings [B, T, D] in place
                                 of the token lookup (gradients with respect to the inputs)

  Every one takes `num_loops` (default: the trained count). With `decode=True` __call__ reads
  and writes the KV cache (collection 'cache', decode.py)."""
  cfg: ModelConfig
  decode: bool = False
  runtime: Runtime = HERE   # the platform and run settings its programs are built for
  probe: bool = False       # sow the attention probes (apply with mutable=['intermediates'])

  def __call__(self, tokens_BT, *, num_loops: int | None = None,
               early_exit: bool | None = None, return_routing: bool = False):
    """See the class docstring."""
    return self._forward(tokens_BT, None, num_loops,
                         Want(routing=return_routing, early_exit=early_exit))

  def hidden(self, tokens_BT, *, num_loops: int | None = None, backprop_loops: int = 0,
             early_exit: bool | None = None):
    """See the class docstring."""
    return self._forward(tokens_BT, None, num_loops,
                         Want(hidden=True, backprop_loops=backprop_loops, early_exit=early_exit))

  def gate_outputs(self, tokens_BT, *, num_loops: int | None = None, backprop_loops: int = 0):
    """See the class docstring (`backprop_loops` > 0 is refused: gate training backpropagates
    through every pass)."""
    return self._forward(tokens_BT, None, num_loops,
                         Want(hidden=True, pass_outputs=True, backprop_loops=backprop_loops))

  def from_embeddings(self, x_BTD, *, num_loops: int | None = None):
    """See the class docstring."""
    return self._forward(None, x_BTD, num_loops, Want())

  @nn.compact
  def _forward(self, tokens_BT, x_BTD, num_loops, want: Want):
    """The forward every entry point runs (one path: `want` only adds outputs)."""
    c = self.cfg
    num_loops = self._check_loops(num_loops)
    pass_outputs, exiting, gate = self._exit_plan(num_loops, want)
    embed_VD, x_BTD = self._embed(tokens_BT, x_BTD)
    positions_BT = self._positions(x_BTD.shape[0], x_BTD.shape[1])
    bias = self._router_bias()
    readout = early_exit_lib.readout(self, embed_VD, gate, head_matrix) if exiting else None
    request = CoreRequest(want.backprop_loops, readout, pass_outputs)
    x_BTD, per_visit, coda, core = self._segments(x_BTD, positions_BT, num_loops, bias,
                                                  want.routing, request)
    final_norm = RMSNorm(c.norm_gain, c.norm_eps, c.param_dtype, name='final_norm')
    x_BTD = final_norm(x_BTD)
    head_DV = None if c.tie_embeddings else param(
        self, 'head', (c.d_model, c.vocab_size), ('embed', 'vocab'), fan_in_init([0], [1]),
        DTYPES[c.param_dtype])
    if c.exit == 'gate' and gate is None:  # made last: the other params' init is unchanged
      early_exit_lib.gate_params(self, c.d_model, DTYPES[c.param_dtype])
    extras = _extras(per_visit, want.routing)
    if core is not None and core.exit_passes_BT is not None:
      extras['exit'] = early_exit_lib.extras(core.exit_passes_BT)
    if core is not None and core.pass_states_LBTD is not None:
      return self._pass_outputs(core.pass_states_LBTD, x_BTD, coda, final_norm, positions_BT,
                                bias.get('coda'), embed_VD, gate), extras
    if want.hidden:
      return x_BTD, extras
    logits_BTV = x_BTD @ head_matrix(c, {'embed': embed_VD, 'head': head_DV},
                                     runtime=self.runtime)
    return logits_BTV.astype(jnp.float32), extras

  def _segments(self, x_BTD, positions_BT, num_loops, bias, routing: bool,
                request: CoreRequest):
    """(states after the coda, {segment: statistics}, the coda module or None, the core's
    CoreOutputs or None): prelude, core x num_loops (`request`) and coda."""
    c = self.cfg
    per_visit: dict[str, Any] = {}
    core = None
    seg_kw = dict(decode=self.decode, record=routing, probe=self.probe,
                  runtime=dispatch.settle(self.runtime.resolved()))  # one self-check a trace
    # prelude and coda, rematerialised like the core's passes
    stack = remat(Stack, self.runtime.run.remat)
    if c.prelude_layers:
      x_BTD, per_visit['prelude'] = stack(c, c.prelude_layers, c.prelude_experts, **seg_kw,
                                          name='prelude')(x_BTD, None, None, positions_BT,
                                                          bias.get('prelude'))
    if c.core_layers:
      core = Core(c, **seg_kw, name='core')(x_BTD, positions_BT, num_loops, bias.get('core'),
                                            request)
      x_BTD, per_visit['core'] = core.x_BTD, core.stats
    coda = stack(c, c.coda_layers, c.coda_experts, **seg_kw, name='coda') if (
        c.coda_layers) else None
    if coda is not None:
      x_BTD, per_visit['coda'] = coda(x_BTD, None, None, positions_BT, bias.get('coda'))
    return x_BTD, per_visit, coda, core

  def _exit_plan(self, num_loops, want: Want):
    """(pass_outputs, exiting, the exit gate's params or None) of one forward, with its
    refusals: gate training's settings, and a backprop_loops the passes cannot take."""
    c = self.cfg
    pass_outputs = want.pass_outputs and not self.is_initializing()
    if pass_outputs and (c.exit != 'gate' or not c.core_layers or not want.hidden or
                         want.early_exit or self.decode):
      raise ValueError("gate_outputs is gate training: it needs model.exit='gate' and "
                       'model.core_layers >= 1, and does not decode')
    exiting = (c.exit != 'none' and c.core_layers > 0 and not self.is_initializing() and
               (self.decode if want.early_exit is None else want.early_exit))
    gate = early_exit_lib.gate_params(self, c.d_model, DTYPES[c.param_dtype]) if (
        (exiting or pass_outputs) and c.exit == 'gate') else None  # a missing gate fails here
    if not 0 <= want.backprop_loops <= num_loops:
      raise ValueError(f'backprop_loops={want.backprop_loops}: must lie in [0, {num_loops}], '
                       'the passes this forward runs (0: all of them)')
    return pass_outputs, exiting, gate

  def _embed(self, tokens_BT, x_BTD):
    """(the embedding table [V, D], the inputs [B, T, D] in the compute dtype): the tokens'
    rows of the table, or the given embeddings `x_BTD`."""
    c = self.cfg
    embed_VD = param(self, 'embed', (c.vocab_size, c.d_model), ('vocab', 'embed'),
                     nn.initializers.normal(1.0), DTYPES[c.param_dtype])
    if x_BTD is None:  # the table gathered whole over its width first (an FSDP parameter
      # gather), so each batch shard looks up its own tokens: no activation is gathered
      x_BTD = jnp.take(self.runtime.constrain(embed_VD, ('vocab', None)), tokens_BT, axis=0)
    return embed_VD, self.runtime.constrain(x_BTD.astype(DTYPES[c.dtype]), ACTIVATION)

  def _router_bias(self) -> dict:
    """{segment: bias} of model.router_bias (the variables' ROUTER_BIAS collection; zeros at
    init), {} without one; applying without the trained bias is refused."""
    c = self.cfg
    if c.router_bias == 'none':
      return {}
    if not (self.is_initializing() or self.has_variable(ROUTER_BIAS, 'bias')):
      raise ValueError(f'model.router_bias={c.router_bias!r}: apply needs the trained bias, '
                       f"variables {{'params': ..., '{ROUTER_BIAS}': ...}} (the train state's "
                       f"'{ROUTER_BIAS}', or train.run.RunDir.load)")
    return self.variable(ROUTER_BIAS, 'bias', lambda: {
        seg: jnp.zeros(shape, jnp.float32) for seg, shape in bias_shapes(c).items()}).value

  def _pass_outputs(self, states_LBTD, x_BTD, coda, final_norm, positions_BT, coda_bias,
                    embed_VD, gate) -> PassOutputs:
    """Gate training's outputs from every pass's core state (PassOutputs; the last pass's
    hidden state is `x_BTD`, the plain forward's)."""
    n = states_LBTD.shape[0]
    coda_fn = None if coda is None else (lambda h: coda(
        h, None, None, jnp.repeat(positions_BT, n - 1, axis=0), coda_bias)[0])
    return PassOutputs(early_exit_lib.pass_outputs(states_LBTD, x_BTD, coda_fn, final_norm),
                       early_exit_lib.pass_lambda(
                           early_exit_lib.readout(self, embed_VD, gate, head_matrix),
                           states_LBTD))

  def _check_loops(self, num_loops):
    return check_loops(self.cfg, num_loops)

  def _positions(self, batch, length):
    base = jnp.arange(length, dtype=jnp.int32)
    if self.decode:
      initialized = self.has_variable('cache', 'position')
      pos = self.variable('cache', 'position', lambda: jnp.zeros((), jnp.int32))
      base = base + pos.value[..., None]  # a position per row ([B]) or one for all (scalar)
      if initialized:
        pos.value = pos.value + length
    return jnp.broadcast_to(base, (batch, length))


def head_matrix(c: ModelConfig, params, dtype=None, *, runtime: Runtime):
  """The output head [D, V] from the model's params (their 'embed' and 'head'), in `dtype`
  (default the compute dtype): the untied 'head', or the tied embedding table transposed over
  sqrt(d_model) (gathered whole over its width first, the same parameter gather as the
  lookup)."""
  dt = dtype or DTYPES[c.dtype]
  if c.tie_embeddings:
    table_VD = runtime.constrain(params['embed'], ('vocab', None))
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
  """`model` (a LoopedMoE, or any module holding a `runtime`, such as an MoE layer) with the
  run settings that are cheapest to trace and change no parameter (dispatch 'xla',
  attention 'xla'): init traces the forward to find the params, and the CPU default
  dispatch ('tiled') or a Pallas kernel traces in about twice the time. Names, shapes, init
  values and the router-bias and cache collections are the same
  (tests/test_model.py::test_init_is_the_same_under_every_dispatch_and_attention)."""
  return model.clone(runtime=model.runtime.with_run(dispatch='xla', attention_impl='xla'))


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
