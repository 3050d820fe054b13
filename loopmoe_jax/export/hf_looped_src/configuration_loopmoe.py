"""Configuration of a looped Mixture-of-Experts language model exported by loopmoe_jax
(`scripts/export.py --format=hf-looped`): a prelude of ordinary layers, a core of
`core_layers` layers whose weights are shared and run `num_loops` times, and a coda.

`num_loops` is the pass count a forward runs when none is given; the export writes the trained
count (`trained_loops`) there. Choose another at load time,
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True, num_loops=6)`, or per call,
`model(input_ids, num_loops=6)` / `model.generate(..., num_loops=6)`; it must lie in
[1, max_loops], and with per-pass attention (tie_attention False) at most trained_loops.

`exit` ('none', 'kl' or 'gate') is the per-token early exit from the core, applied in
`generate` and in a forward given a cache (core_loopmoe.py), with `exit_threshold` (gate: the
cumulative exit probability at which a token exits, in (0, 1]; kl: the KL divergence between
consecutive passes below which it exits, > 0). 'gate' needs the trained gate (`exit_gate`,
a model trained with it); 'kl' runs on any model; 'none' runs every pass. Set them at load
like num_loops: `from_pretrained(DIR, trust_remote_code=True, exit='none')`.

`kv_cache` is the core's KV-cache layout when decoding: 'per_pass' (one entry per executed
pass and layer: decoding is the full forward exactly), or one entry per core layer holding
the last pass's K/V ('last_pass') or the first's ('first_pass'), as loopmoe_jax's decode
keeps them (core_loopmoe.SharedKV); a decoding option, settable at load.
"""
from transformers import PretrainedConfig

ROUTER_SCORES = ('softmax', 'sigmoid')
ROUTER_BIASES = ('none', 'shared', 'per_pass')
INJECTIONS = ('none', 'add', 'concat')
EXITS = ('none', 'kl', 'gate')
KV_CACHES = ('per_pass', 'last_pass', 'first_pass')


class LoopMoEConfig(PretrainedConfig):
  """Every architecture field the forward reads (names as in loopmoe_jax's model config,
  where HF has no common name of its own)."""
  model_type = 'loopmoe'

  def __init__(self, vocab_size=256, hidden_size=64, num_attention_heads=4,
               num_key_value_heads=None, head_dim=None, expert_width=128,
               num_experts_per_tok=2, renormalize=True, router_score='softmax',
               router_bias='none', max_expert_devices=0, expert_devices=0,
               num_shared_experts=0, shared_expert_width=0, prelude_layers=1,
               prelude_experts=4, core_layers=2, core_experts=4, num_loops=2,
               trained_loops=None, max_loops=None, coda_layers=1, coda_experts=4,
               tie_attention=True, residual_scale='none', scale_passes='trained',
               injection='none', tie_embeddings=False, norm_gain=True, rms_norm_eps=1e-6,
               rope_theta=10000.0, exit='none', exit_threshold=0.0, exit_gate=False,
               kv_cache='per_pass', max_position_embeddings=4096, use_cache=True, **kwargs):
    self.vocab_size = vocab_size
    self.hidden_size = hidden_size
    self.num_attention_heads = num_attention_heads
    self.num_key_value_heads = num_key_value_heads or num_attention_heads
    self.head_dim = head_dim or hidden_size // num_attention_heads
    self.expert_width = expert_width
    self.num_experts_per_tok = num_experts_per_tok
    self.renormalize = renormalize
    self.router_score = router_score
    self.router_bias = router_bias
    self.max_expert_devices = max_expert_devices
    self.expert_devices = expert_devices
    self.num_shared_experts = num_shared_experts
    self.shared_expert_width = shared_expert_width or expert_width
    self.prelude_layers, self.prelude_experts = prelude_layers, prelude_experts
    self.core_layers, self.core_experts = core_layers, core_experts
    self.coda_layers, self.coda_experts = coda_layers, coda_experts
    self.trained_loops = trained_loops or num_loops
    self.max_loops = max_loops or 8 * self.trained_loops
    self.num_loops = num_loops
    self.tie_attention = tie_attention
    self.residual_scale = residual_scale
    self.scale_passes = scale_passes
    self.injection = injection
    self.tie_embeddings = tie_embeddings
    self.norm_gain = norm_gain
    self.rms_norm_eps = rms_norm_eps
    self.rope_theta = rope_theta
    self.max_position_embeddings = max_position_embeddings
    self.use_cache = use_cache
    self.exit, self.exit_threshold, self.exit_gate = exit, exit_threshold, exit_gate
    self.kv_cache = kv_cache
    for name, value, allowed in (('router_score', router_score, ROUTER_SCORES),
                                 ('router_bias', router_bias, ROUTER_BIASES),
                                 ('injection', injection, INJECTIONS)):
      if value not in allowed:
        raise ValueError(f'{name}={value!r}: must be one of {allowed}')
    check_exit(self)
    check_kv_cache(self)
    # the head is computed from the embedding table in the forward (tie_embeddings): nothing
    # for transformers to tie
    kwargs['tie_word_embeddings'] = False
    super().__init__(**kwargs)

  @property
  def num_hidden_layers(self) -> int:
    """The KV-cache entries of a forward at `num_loops` passes: one per executed layer, the
    core's one per layer under a shared kv_cache."""
    core = self.num_loops if getattr(self, 'kv_cache', 'per_pass') == 'per_pass' else 1
    return self.prelude_layers + self.core_layers * core + self.coda_layers

  @num_hidden_layers.setter
  def num_hidden_layers(self, value):
    del value  # derived from the layout and num_loops; a stored value is ignored


def check_exit(config) -> str:
  """config.exit, checked with its threshold (fields set at load are checked at the forward):
  a one-line ValueError naming the field."""
  rule, t = getattr(config, 'exit', 'none'), getattr(config, 'exit_threshold', 0.0)
  number = not isinstance(t, bool) and isinstance(t, (int, float))
  if rule not in EXITS:
    raise ValueError(f'exit={rule!r}: must be one of {EXITS}')
  if rule == 'kl' and not (number and 0 < t < float('inf')):
    raise ValueError(f"exit_threshold={t!r}: exit='kl' needs a finite threshold > 0 (e.g. 1e-3)")
  if rule == 'gate' and not (number and 0 < t <= 1):
    raise ValueError(f"exit_threshold={t!r}: exit='gate' needs a threshold in (0, 1] (e.g. 0.5)")
  if rule == 'gate' and not getattr(config, 'exit_gate', False):
    raise ValueError("exit='gate': this model has no trained exit gate (exit_gate=False); use "
                     "exit='kl' (no training needed) or 'none'")
  return rule


def check_kv_cache(config) -> str:
  """config.kv_cache, checked (a one-line ValueError naming the field)."""
  layout = getattr(config, 'kv_cache', 'per_pass')
  if layout not in KV_CACHES:
    raise ValueError(f'kv_cache={layout!r}: must be one of {KV_CACHES}')
  if layout != 'per_pass' and not config.tie_attention and config.trained_loops > 1:
    raise ValueError(f"kv_cache={layout!r}: one K/V entry per core layer for every pass needs "
                     "tied attention; this model has per-pass attention (use 'per_pass')")
  return layout
