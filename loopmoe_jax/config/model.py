"""Model configuration: one frozen dataclass, built once from an ml_collections ConfigDict.

The model is a prelude of ordinary layers, a core block of `core_layers` layers applied
`num_loops` times over shared weights, and a coda. Every layer is attention + a SwiGLU
feed-forward that is a routed MoE (`*_experts >= 1`) or dense (`*_experts == 0`).

Layout helpers turn paper recipes into these fields: `middle_span` (SMELT: loop the middle
X% of an N-layer stack r times), `loop_span` (any contiguous span) and `flatten` (Foil:
(E, D, L) -> (aE, D/a, aL)).
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Mapping

from loopmoe_jax.config.fields import from_mapping
from loopmoe_jax.config.run import RUN_FIELDS, RunConfig  # noqa: F401  (config's names)

RESIDUAL_SCALES = ('none', 'inverse_loops')
SCALE_PASSES = ('trained', 'executed')
INJECTIONS = ('none', 'add', 'concat')
DTYPES = ('float32', 'bfloat16', 'float16')
OVERFLOWS = ('drop', 'replay')
ROUTER_SCORES = ('softmax', 'sigmoid')
ROUTER_BIASES = ('none', 'shared', 'per_pass')
KV_CACHES = ('per_pass', 'last_pass', 'first_pass')
EXITS = ('none', 'kl', 'gate')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The architecture (config section `model`): every field that decides the parameters or
  which assignments are computed. How the parameters run (section `run`, RunConfig) is the
  runtime's (runtime.Runtime.run), passed to the model beside it. Field names are the config
  keys."""
  vocab_size: int = 256
  d_model: int = 64
  num_heads: int = 4
  num_kv_heads: int = 0          # 0: same as num_heads (MHA)
  head_dim: int = 0              # 0: d_model // num_heads (must divide)
  # Feed-forward / MoE.
  expert_width: int = 128        # F, hidden width of one SwiGLU expert (or the dense MLP)
  top_k: int = 2
  renormalize: bool = True       # Mixtral: softmax over all experts, renormalise over top-k
  router_score: str = 'softmax'  # 'sigmoid' (DeepSeek-V3): sigmoid affinities, the weights
                                 # always normalised over the k chosen
  router_bias: str = 'none'      # aux-loss-free balancing: a per-expert bias on the selection
                                 # scores (never on the weights), moved by train.bias_rate after
                                 # each step; 'shared' one per MoE layer, 'per_pass' one per
                                 # (pass, layer) in the core
  max_expert_devices: int = 0    # > 0: device-limited routing (DeepSeek-V3's node-limited
                                 # routing over devices): a token's top-k is taken among the
                                 # experts of its best M device groups, a group scored by the
                                 # sum of its ceil(k / M) highest selection scores (moe.py,
                                 # limit_groups). A change of the model (other choices), never
                                 # made by a planner; 0: off
  expert_devices: int = 0        # the device groups that rule counts: each MoE segment's
                                 # experts in this many contiguous groups, the devices of
                                 # mesh.expert when it is this size (then a token's rows go to
                                 # at most M devices)
  num_shared_experts: int = 0
  shared_expert_width: int = 0   # 0: expert_width
  capacity_factor: float = 0.0   # 0: dropless; else each expert takes at most
                                 # ceil(cf * tokens * k / E) of a batch shard's assignments
  exchange_buffer_factor: float = 0.0  # 0: exchange buffers for the dropless worst case; b >= 1:
                                 # rows one device sends another capped at b x the balanced
                                 # share (expert_parallel.slot_rows), the rest dropped, counted
  exchange_overflow: str = 'drop'  # with exchange_buffer_factor: 'drop' (count them) or 'replay'
                                 # (a train step that dropped a row reruns with dropless
                                 # buffers and remat 'full'; train/step.py)
  # Layout: prelude -> core x num_loops -> coda. experts == 0 means a dense SwiGLU layer.
  prelude_layers: int = 1
  prelude_experts: int = 4
  core_layers: int = 2
  core_experts: int = 4
  num_loops: int = 2
  coda_layers: int = 1
  coda_experts: int = 4
  # Loop options.
  tie_attention: bool = True     # False: each pass has its own attention ("Foil")
  residual_scale: str = 'none'   # 'inverse_loops': every write inside the core scaled by 1/r
  scale_passes: str = 'trained'  # r of that 1/r when a forward runs another pass count than
                                 # the trained one: 'trained' (model.num_loops) or 'executed'
  injection: str = 'none'        # prelude output injected into each pass: none | add | concat
  kv_cache: str = 'per_pass'     # decoding only (decode.py): the core's KV cache keeps one slot
                                 # per (pass, layer) ('per_pass'), or one per layer holding the
                                 # last pass's K/V ('last_pass', Huginn) or the first pass's
                                 # ('first_pass', Mixture-of-Recursions); training and the
                                 # full-sequence forward are the same under all three
  exit: str = 'none'             # per-token early exit from the core (early_exit.py): 'kl'
                                 # (zero-shot, Huginn) or 'gate' (a learned exit gate, Ouro);
                                 # applied when decoding, or in a forward with early_exit=True
  exit_threshold: float = 0.0    # kl: exit when KL(pass p || pass p-1) < it (> 0); gate: when the
                                 # cumulative exit probability >= it (in (0, 1])
  exit_entropy: float = 0.0      # gate training: the weight of the exit distribution's entropy
  # Embeddings, norms, positions.
  tie_embeddings: bool = False
  norm_gain: bool = True
  norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  dtype: str = 'float32'         # compute dtype; params stay param_dtype
  param_dtype: str = 'float32'

  def __post_init__(self):
    _validate(self)

  def architecture(self) -> dict[str, Any]:
    """The fields of section `model`."""
    return dataclasses.asdict(self)

  # Derived shapes -------------------------------------------------------------------------
  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def resolved_head_dim(self) -> int:
    """K, the head dim in force: model.head_dim, or d_model // num_heads when it is 0 (one
    concept, one name: the setting and its value)."""
    return self.head_dim or self.d_model // self.num_heads

  @property
  def shared_width(self) -> int:
    return self.shared_expert_width or self.expert_width

  @property
  def segments(self) -> tuple[tuple[str, int, int, int], ...]:
    """(name, layers, experts, passes) for prelude, core and coda, skipping empty ones."""
    segs = (('prelude', self.prelude_layers, self.prelude_experts, 1),
            ('core', self.core_layers, self.core_experts, self.num_loops),
            ('coda', self.coda_layers, self.coda_experts, 1))
    return tuple(s for s in segs if s[1] > 0)

  @property
  def executed_layers(self) -> int:
    return self.prelude_layers + self.core_layers * self.num_loops + self.coda_layers

  def replace(self, **kw) -> 'ModelConfig':
    return dataclasses.replace(self, **kw)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], where: str = 'model') -> 'ModelConfig':
    return from_mapping(cls, d, where, _check_model_key)


def _refuse_run_fields(init):
  """ModelConfig's dataclass __init__ (and so `replace`), refusing a run setting by name."""
  def checked(self, *args, **fields):
    for key in fields:
      if key in RUN_FIELDS:
        _refuse_run_field(key)
    init(self, *args, **fields)
  checked.__doc__, checked.__wrapped__ = init.__doc__, init
  return checked


ModelConfig.__init__ = _refuse_run_fields(ModelConfig.__init__)


def _check_model_key(key: str):
  """A run setting given in section `model` is refused by name."""
  if key in RUN_FIELDS:
    _refuse_run_field(key)


def _refuse_run_field(key: str):
  raise ValueError(f'model.{key} is a run setting, not architecture: set run.{key} (the '
                   f'config section `run`), or in code pass it in the model\'s runtime, '
                   f'LoopedMoE(cfg, runtime=Runtime.of({key}=...)) (runtime.py)')


def _err(field: str, value: Any, why: str):
  raise ValueError(f'model.{field}={value!r}: {why}')


def _validate(c: ModelConfig):
  for name in ('vocab_size', 'd_model', 'num_heads', 'expert_width', 'top_k', 'num_loops'):
    if getattr(c, name) < 1:
      _err(name, getattr(c, name), 'must be >= 1')
  for name in ('num_kv_heads', 'head_dim', 'prelude_layers', 'core_layers', 'coda_layers',
               'prelude_experts', 'core_experts', 'coda_experts', 'num_shared_experts',
               'shared_expert_width'):
    if getattr(c, name) < 0:
      _err(name, getattr(c, name), 'must be >= 0')
  if not c.head_dim and c.d_model % c.num_heads:
    _err('num_heads', c.num_heads, f'does not divide model.d_model={c.d_model} '
         '(set model.head_dim to use another head dim)')
  if c.resolved_head_dim % 2:
    _err('head_dim', c.resolved_head_dim, 'RoPE needs an even head dim')
  if c.num_heads % c.kv_heads:
    _err('num_kv_heads', c.num_kv_heads, f'GQA groups: must divide model.num_heads={c.num_heads}')
  for seg, layers, experts, _ in c.segments:
    if experts and c.top_k > experts:
      _err('top_k', c.top_k, f'exceeds model.{seg}_experts={experts}')
  if c.executed_layers < 1:
    _err('core_layers', c.core_layers, 'the model has no layers')
  choices = dict(residual_scale=RESIDUAL_SCALES, injection=INJECTIONS, dtype=DTYPES,
                 param_dtype=DTYPES, exchange_overflow=OVERFLOWS, scale_passes=SCALE_PASSES,
                 router_score=ROUTER_SCORES, router_bias=ROUTER_BIASES, kv_cache=KV_CACHES,
                 exit=EXITS)
  for name, allowed in choices.items():
    if getattr(c, name) not in allowed:
      _err(name, getattr(c, name), f'must be one of {allowed}')
  if not (c.capacity_factor == 0 or 0 < c.capacity_factor < float('inf')):  # NaN fails both
    _err('capacity_factor', c.capacity_factor, 'must be 0 (dropless) or finite and > 0')
  b = c.exchange_buffer_factor
  if isinstance(b, bool) or not isinstance(b, (int, float)) or not (b == 0 or 1 <= b < float('inf')):
    _err('exchange_buffer_factor', b, 'must be 0 (worst-case buffers, dropless) or a number >= 1 '
         '(the balanced share times it; 1.25 is a common choice)')
  if c.exchange_overflow == 'replay' and not (b and not c.capacity_factor):
    _err('exchange_overflow', c.exchange_overflow, 'replays the rows that bounded exchange '
         'buffers dropped: it needs model.exchange_buffer_factor >= 1 (now '
         f'{b}) and model.capacity_factor=0 (now {c.capacity_factor})')
  if c.injection != 'none' and not c.core_layers:
    _err('injection', c.injection, 'needs a looped core (model.core_layers >= 1)')
  if c.router_bias != 'none' and not any(experts for _, _, experts, _ in c.segments):
    _err('router_bias', c.router_bias, "the model has no MoE layer (set model.router_bias='none' "
         'or give a segment experts, e.g. model.core_experts=8)')
  if c.kv_cache != 'per_pass' and not c.tie_attention and c.num_loops > 1 and c.core_layers:
    _err('kv_cache', c.kv_cache, 'shares one K/V cache slot per core layer across the passes, but '
         'model.tie_attention=False gives every pass its own K and V projections, so a pass would '
         "attend to keys and values another pass's projections made: use "
         "model.kv_cache='per_pass' (or a model trained with model.tie_attention=True)")
  _validate_exit(c)
  _validate_device_limit(c)
  if c.router_bias == 'per_pass' and not (c.core_layers and c.core_experts and c.num_loops > 1):
    _err('router_bias', c.router_bias, 'needs a looped MoE core (model.core_layers >= 1, '
         "model.core_experts >= 1, model.num_loops >= 2); use model.router_bias='shared'")


def _validate_device_limit(c: ModelConfig):
  m, g = c.max_expert_devices, c.expert_devices
  for name, v in (('max_expert_devices', m), ('expert_devices', g)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
      _err(name, v, 'must be an integer >= 0 (0: off)')
  if not m:
    return
  if not g:
    _err('expert_devices', g, f'model.max_expert_devices={m} needs the number of device groups '
         'it counts (the size of mesh.expert the model trains on, e.g. 8)')
  if m > g:
    _err('max_expert_devices', m, f'exceeds the device groups, model.expert_devices={g}')
  for seg, _, experts, _ in c.segments:
    if experts and experts % g:
      _err('expert_devices', g, f'does not divide model.{seg}_experts={experts}')
    if experts and m * (experts // g) < c.top_k:
      _err('max_expert_devices', m, f'leaves {m} x {experts // g} experts of model.{seg}_experts '
           f'for model.top_k={c.top_k}')


def _validate_exit(c: ModelConfig):
  t = c.exit_threshold
  number = not isinstance(t, bool) and isinstance(t, (int, float))
  if c.exit == 'kl' and not (number and 0 < t < float('inf')):
    _err('exit_threshold', t, "model.exit='kl' exits when the KL divergence between consecutive "
         'passes falls below it: set a finite threshold > 0 (e.g. 1e-3)')
  if c.exit == 'gate' and not (number and 0 < t <= 1):
    _err('exit_threshold', t, "model.exit='gate' exits when the cumulative exit probability "
         'reaches it: set a threshold in (0, 1] (e.g. 0.5)')
  e = c.exit_entropy
  if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 <= e < float('inf'):
    _err('exit_entropy', e, 'must be a finite number >= 0')
  if c.exit != 'none' and not c.core_layers:
    _err('exit', c.exit, "early exit leaves the looped core: it needs model.core_layers >= 1 "
         "(or use model.exit='none')")


# Layout helpers ---------------------------------------------------------------------------

def loop_span(num_layers: int, start: int, stop: int, loops: int) -> dict[str, int]:
  """Loops layers [start, stop) of a `num_layers` stack `loops` times."""
  if num_layers < 1:
    raise ValueError(f'num_layers={num_layers}: must be >= 1')
  if not 0 <= start < stop <= num_layers:
    raise ValueError(f'span=[{start}, {stop}) lies outside the stack of num_layers={num_layers}')
  if loops < 1:
    raise ValueError(f'loops={loops}: must be >= 1')
  return dict(prelude_layers=start, core_layers=stop - start, coda_layers=num_layers - stop,
              num_loops=loops)


def middle_span(num_layers: int, fraction: float, loops: int) -> dict[str, int]:
  """SMELT: loop the contiguous middle `fraction` of the stack (0.5 of 12 -> layers 3..8)."""
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f'span fraction={fraction}: must lie in (0, 1] (span outside the stack)')
  span = max(1, round(num_layers * fraction))
  start = (num_layers - span) // 2
  return loop_span(num_layers, start, start + span, loops)


def flatten(experts: int, layers: int, loops: int, factor: int) -> tuple[int, int, int]:
  """Foil: (E, D, L) -> (aE, D/a, aL), which keeps E*D, D*L and k*D*L."""
  if factor < 1 or layers % factor:
    raise ValueError(f'flatten factor={factor} does not divide core_layers D={layers}')
  return experts * factor, layers // factor, loops * factor


def parse_arg(arg: str | None, defaults: Mapping[str, Any],
              choices: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """Parses a config-file argument 'name,key=value,flag' against typed `defaults`.

  A bare word sets a bool default to True, selects the key whose `choices` hold it (so
  'smelt.py:200m' picks size=200m), or else sets the 'variant' key. A value outside a key's
  choices, and unknown keys, raise naming them (unknown keys with near names).
  """
  out = dict(defaults)
  choices = dict(choices or {})
  for tok in filter(None, (t.strip() for t in (arg or '').split(','))):
    key, eq, val = tok.partition('=')
    if not eq:
      if isinstance(defaults.get(key), bool):
        out[key] = True
        continue
      owner = next((k for k, allowed in choices.items() if tok in allowed), None)
      if owner is None and 'variant' not in defaults:
        raise ValueError(f'config argument {tok!r}: not a flag' + ''.join(
            f'; {k} is one of {sorted(v)}' for k, v in choices.items()) +
            f'; known keys {sorted(defaults)}')
      key, val = owner or 'variant', tok
    if key not in defaults:
      near = difflib.get_close_matches(key, list(defaults), n=3, cutoff=0.5)
      raise ValueError(f'config argument {key!r} is unknown' +
                       (f'; did you mean {near}?' if near else f'; known {sorted(defaults)}'))
    if key in choices and val not in choices[key]:
      raise ValueError(f'config argument {key}={val!r}: must be one of {sorted(choices[key])}')
    typ = type(defaults[key])
    if typ is bool:
      if val.lower() not in ('1', 'true', 'yes', '0', 'false', 'no'):
        raise ValueError(f'config argument {key}={val!r}: expected a bool')
      out[key] = val.lower() in ('1', 'true', 'yes')
    else:
      try:
        out[key] = typ(val)
      except ValueError:
        raise ValueError(f'config argument {key}={val!r}: expected {typ.__name__}') from None
  return out


# Config files ---------------------------------------------------------------------------------

SMOKE_MODEL = dict(vocab_size=256, d_model=64, num_heads=4, head_dim=16, expert_width=64,
                   shared_expert_width=0)


def model_config_dict(smoke: bool = False, **fields):
  """A ConfigDict holding every architecture field of ModelConfig (section `model`; so a
  typo in --config.model.X fails), the given fields applied, and with `smoke` the widths
  shrunk to CPU size (layers, experts, passes and top-k kept). GQA keeps its group count
  where it still divides the heads. Run settings given here (dispatch='xla') stay in it
  until experiment.experiment_config moves them to section `run`."""
  import ml_collections
  base = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
  for key in fields:
    if key not in base and key not in RUN_FIELDS:
      raise ValueError(f'unknown config field model.{key}')
  base.update(fields)
  run = {k: base.pop(k) for k in RUN_FIELDS if k in base}
  if smoke:
    groups = base['num_heads'] // (base['num_kv_heads'] or base['num_heads'])
    base.update(SMOKE_MODEL)
    base['num_kv_heads'] = base['num_heads'] // groups if base['num_heads'] % groups == 0 else 0
  ModelConfig(**base)  # validate now, naming the field
  RunConfig(**run)
  return ml_collections.ConfigDict({**base, **run})
