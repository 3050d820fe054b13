"""A looped Mixture-of-Experts causal LM exported by loopmoe_jax, in plain PyTorch.

embed -> prelude -> core layers x num_loops (shared weights) -> coda -> RMSNorm -> head. Each
layer: pre-norm attention and a pre-norm SwiGLU feed-forward, routed (`*_experts` >= 1) or
dense (0). Inside the core every write is scaled by 1/r with residual_scale 'inverse_loops'
(r: trained_loops, or the executed count with scale_passes 'executed'); routing is recomputed
on every visit (softmax, top-k renormalised when `renormalize`, or sigmoid normalised over
the k); the trained router bias (`model.router_bias.<segment>`; per (pass, layer) with
'per_pass', a pass past the trained ones reusing the last) picks the experts, never weights
them; `injection` adds (or with 'concat' projects) the core's input at every pass; with
`tie_attention` False each pass has its own attention (`model.core.pass_attn_<i>.*`, a
leading pass axis). RoPE rotate-half; query head h reads kv head h // (H / G); tied
embeddings: the head is embed.T / sqrt(hidden_size). Parameters: `model.` + loopmoe_jax's
names in its layouts (q/k/v [D, heads, K], o [H, K, D], router [D, E], experts [E, D, F] /
[E, F, D]). KV cache: one DynamicCache entry per executed (pass, layer), prelude first;
under kv_cache 'last_pass' / 'first_pass' one per core layer (core_loopmoe.SharedKV).
Per-token early exit from the core (config.exit 'gate' or 'kl'): core_loopmoe.py. Modules:
layers_loopmoe.py (the layers), core_loopmoe.py (the loop and its exit), this file (the
model, its cache and the transformers class).
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_loopmoe import LoopMoEConfig, check_exit, check_kv_cache
from .core_loopmoe import Core, Readout, SharedKV
from .layers_loopmoe import Norm, Stack


class Context:
  """What every attention call of one forward shares: positions [B, T], the cache, and the
  key mask [B, T, S] (causal by slot, and the 2-D attention_mask's padding)."""

  def __init__(self, positions, cache, attention_mask, past, shared=None):
    self.positions, self.cache, self.mask_2d, self.past = positions, cache, attention_mask, past
    self.shared = shared  # core_loopmoe.SharedKV under a shared KV layout, or None

  def kv(self, k, v, layer_idx):
    """The keys and values [B, G, S, K] executed layer `layer_idx` attends to: the cache
    entry's earlier ones and these (the entry updated), or under a shared layout SharedKV's."""
    if self.shared is not None:
      return self.shared.attend(self.cache, k, v, layer_idx, self.past)
    return self.cache.update(k, v, layer_idx)

  def mask(self, keys):
    t, device = self.positions.shape[1], self.positions.device
    allowed = (torch.arange(keys, device=device)[None, :] <=
               torch.arange(t, device=device)[:, None] + self.past)[None]
    return allowed if self.mask_2d is None else allowed & self.mask_2d[:, None, :keys].bool()


class RouterBias(nn.Module):
  """The trained router bias, one buffer per MoE segment: [layers, E], the core's
  [trained passes, layers, E] with router_bias 'per_pass'."""

  def __init__(self, config):
    super().__init__()
    c = config
    for seg, layers, experts in (('prelude', c.prelude_layers, c.prelude_experts),
                                 ('core', c.core_layers, c.core_experts),
                                 ('coda', c.coda_layers, c.coda_experts)):
      if layers and experts:
        per_pass = seg == 'core' and c.router_bias == 'per_pass'
        shape = (c.trained_loops, layers, experts) if per_pass else (layers, experts)
        self.register_buffer(seg, torch.zeros(shape, dtype=torch.float32))


class LoopMoEModel(nn.Module):
  """embed -> prelude -> core x num_loops -> coda -> final_norm -> head: logits [B, T, V]."""

  def __init__(self, config):
    super().__init__()
    c = self.config = config
    self.embed = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
    if c.prelude_layers:
      self.prelude = Stack(c, c.prelude_layers, c.prelude_experts)
    if c.core_layers:
      self.core = Core(c)
    if c.coda_layers:
      self.coda = Stack(c, c.coda_layers, c.coda_experts)
    self.final_norm = Norm(c)
    if not c.tie_embeddings:
      self.head = nn.Parameter(torch.empty(c.hidden_size, c.vocab_size))
    if c.router_bias != 'none':
      self.router_bias = RouterBias(c)
    if c.exit_gate:  # the trained exit gate (exit 'gate')
      self.exit_gate_w = nn.Parameter(torch.empty(c.hidden_size))
      self.exit_gate_b = nn.Parameter(torch.empty(1))  # loopmoe_jax's scalar b as [1]

  def bias(self, seg):
    """The trained router bias of segment `seg`, or None."""
    return getattr(self.router_bias, seg, None) if hasattr(self, 'router_bias') else None

  def head_matrix(self):
    """The output head [D, V]: the untied 'head', or embed.T / sqrt(hidden_size)."""
    c = self.config
    return self.embed.t() / math.sqrt(c.hidden_size) if c.tie_embeddings else self.head

  def readout(self, head):
    """What config.exit's rule reads (core_loopmoe.Readout), given the head [D, V]."""
    c = self.config
    gain = getattr(self.final_norm, 'scale', None)
    head = head.float() if c.exit == 'kl' else None
    gate = (self.exit_gate_w, self.exit_gate_b) if c.exit == 'gate' else (None, None)
    return Readout(c.exit, c.exit_threshold, gain, c.rms_norm_eps, head, *gate)

  def forward(self, input_ids, ctx, num_loops, exiting=False):
    """Logits [B, T, V] float32; `exiting`: config.exit's per-token exit from the core."""
    c = self.config
    head = self.head_matrix()  # once a forward: the exit's readout and the logits read it
    x = F.embedding(input_ids, self.embed)
    idx = 0
    if c.prelude_layers:
      x = self.prelude(x, ctx, 0, bias=self.bias('prelude'))
      idx = c.prelude_layers
    if c.core_layers:
      x = self.core(x, ctx, idx, num_loops, self.bias('core'),
                    self.readout(head) if exiting else None)
      idx += c.core_layers * num_loops
    if c.coda_layers:
      x = self.coda(x, ctx, idx, bias=self.bias('coda'))
    x = self.final_norm(x)
    return (x @ head.to(x.dtype)).float()


def check_loops(config, num_loops):
  """The pass count a forward runs (None: config.num_loops); a count outside [1, max_loops],
  or past the trained one with per-pass attention, is a one-line ValueError."""
  n = config.num_loops if num_loops is None else num_loops
  if isinstance(n, bool) or not isinstance(n, int):
    raise ValueError(f'num_loops={n!r}: must be an integer')
  if not 1 <= n <= config.max_loops:
    raise ValueError(f'num_loops={n}: must lie in [1, {config.max_loops}] (max_loops, '
                     f'{config.max_loops // config.trained_loops} x the trained '
                     f'{config.trained_loops} passes)')
  if not config.tie_attention and n > config.trained_loops:
    raise ValueError(f'num_loops={n}: this model has per-pass attention weights for its '
                     f'{config.trained_loops} trained passes only (tie_attention=False)')
  return n


def prepare_cache(cache, num_loops, layers, per_pass=True):
  """`cache` ready for a forward of `num_loops` passes over `layers` cache entries: one
  filled at another pass count is refused under the per-pass layout (its entries belong to
  other passes)."""
  past = cache.get_seq_length()
  made = getattr(cache, 'loopmoe_num_loops', None)
  if per_pass and past and made is not None and made != num_loops:
    raise ValueError(f'num_loops={num_loops}: the cache holds {past} tokens run at '
                     f'num_loops={made} (one entry per pass and layer); start a new cache')
  cache.loopmoe_num_loops = num_loops
  if getattr(cache, 'layers', None) is not None and getattr(
      cache, 'layer_class_to_replicate', None) is None:
    while len(cache.layers) < layers:  # a cache sized for another pass count
      cache.layers.append(DynamicLayer())
  return past


_CACHE_FIELD = 'cache' if 'cache' in CausalLMOutputWithPast.__dataclass_fields__ else (
    'past_key_values')


class LoopMoEForCausalLM(PreTrainedModel, GenerationMixin):
  """The causal LM: `forward(input_ids, num_loops=N)` and `generate(..., num_loops=N)` run
  the core N times (default config.num_loops, the trained count unless set at load)."""
  config_class = LoopMoEConfig
  base_model_prefix = 'model'
  _no_split_modules = ['Layer']

  def __init__(self, config):
    super().__init__(config)
    self.model = LoopMoEModel(config)
    self.post_init()

  def _init_weights(self, module):
    """Fresh weights for a model built from a config alone (from_pretrained loads them all)."""
    for name, p in module.named_parameters(recurse=False):
      with torch.no_grad():
        if name == 'scale':
          p.fill_(1.0)
        else:
          p.normal_(0.0, 1.0 if name == 'embed' else 0.02)

  def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
              past_key_values=None, labels=None, use_cache=None, num_loops=None,
              early_exit=None, **kwargs):
    """Logits [B, T, V] (float32) at `num_loops` passes; `cache` (or `past_key_values`) a
    transformers Cache of earlier tokens (one entry per executed pass and layer); a 2-D
    `attention_mask` masks padded keys and gives the positions when `position_ids` is None.
    `early_exit`: config.exit's per-token exit from the core (None: when a cache is given,
    as in `generate`, the way loopmoe_jax applies it when decoding; a forward without one is
    the full forward)."""
    del kwargs  # output_attentions, return_dict, ...: nothing else is returned
    c = self.config
    n = check_loops(c, num_loops)
    cache = cache if cache is not None else past_key_values
    if early_exit and check_exit(c) == 'none':
      raise ValueError("early_exit=True: config.exit='none' has no exit rule; load with "
                       "exit='kl' or exit='gate' (a gate needs trained gate weights)")
    exiting = check_exit(c) != 'none' and c.core_layers > 0 and (
        cache is not None if early_exit is None else bool(early_exit))
    use_cache = c.use_cache if use_cache is None else use_cache
    if use_cache and cache is None:
      cache = DynamicCache()
    b, t = input_ids.shape
    per_pass = check_kv_cache(c) == 'per_pass' or not c.core_layers
    entries = c.prelude_layers + c.core_layers * (n if per_pass else 1) + c.coda_layers
    past = prepare_cache(cache, n, entries, per_pass) if cache is not None else 0
    if attention_mask is not None and attention_mask.shape[-1] != past + t:  # 2-D only
      raise ValueError(f'attention_mask covers {attention_mask.shape[-1]} positions: the cache '
                       f'holds {past} and input_ids adds {t}')
    if position_ids is None:
      if attention_mask is not None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
      else:
        position_ids = (torch.arange(t, device=input_ids.device) + past)[None].expand(b, t)
    shared = None if per_pass or cache is None else SharedKV(
        c.kv_cache, c.prelude_layers, c.core_layers, n)
    ctx = Context(position_ids, cache, attention_mask, past, shared)
    logits = self.model(input_ids, ctx, n, exiting)
    loss = None
    if labels is not None:
      loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                             labels[:, 1:].reshape(-1), ignore_index=-100)
    return CausalLMOutputWithPast(loss=loss, logits=logits,
                                  **{_CACHE_FIELD: cache if use_cache else None})
