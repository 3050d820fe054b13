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
[E, F, D]). KV cache: one DynamicCache entry per executed (pass, layer), prelude first.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_loopmoe import LoopMoEConfig


def rms_norm(x, gain, eps):
  """x / rms(x) (times `gain` when not None), in float32."""
  x = x.float()
  x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
  return x if gain is None else x * gain.float()


class Norm(nn.Module):
  """RMSNorm; a learned gain ('scale') only with config.norm_gain."""

  def __init__(self, config):
    super().__init__()
    self.eps = config.rms_norm_eps
    if config.norm_gain:
      self.scale = nn.Parameter(torch.ones(config.hidden_size))

  def forward(self, x):
    return rms_norm(x, getattr(self, 'scale', None), self.eps).to(x.dtype)


def rope(x, positions, theta):
  """Rotary embedding (rotate-half) of x [B, T, heads, K] at integer positions [B, T]."""
  k = x.shape[-1]
  freq = theta ** (-torch.arange(0, k, 2, dtype=torch.float32, device=x.device) / k)
  angle = positions[:, :, None, None].float() * freq
  sin, cos = torch.sin(angle), torch.cos(angle)
  x1, x2 = x.float().chunk(2, dim=-1)
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class AttentionWeights(nn.Module):
  """q, k, v [D, heads, K] and o [H, K, D]; with `stack` > 0 each has a leading pass axis."""

  def __init__(self, config, stack=0):
    super().__init__()
    c, lead = config, ((stack,) if stack else ())
    d, h, g, k = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    self.q = nn.Parameter(torch.empty(lead + (d, h, k)))
    self.k = nn.Parameter(torch.empty(lead + (d, g, k)))
    self.v = nn.Parameter(torch.empty(lead + (d, g, k)))
    self.o = nn.Parameter(torch.empty(lead + (h, k, d)))

  def weights(self, index=None):
    """{'q', 'k', 'v', 'o'}, pass `index`'s slice of each when given."""
    w = {'q': self.q, 'k': self.k, 'v': self.v, 'o': self.o}
    return w if index is None else {n: a[index] for n, a in w.items()}


def attention(x, w, ctx, layer_idx, theta):
  """Causal attention of x [B, T, D] with weights `w`; K/V go through the cache entry
  `layer_idx` when ctx.cache is set. Scores and softmax in float32."""
  b, t, _ = x.shape
  q = torch.einsum('btd,dhk->bthk', x, w['q'])
  k = torch.einsum('btd,dgk->btgk', x, w['k'])
  v = torch.einsum('btd,dgk->btgk', x, w['v'])
  q, k = rope(q, ctx.positions, theta), rope(k, ctx.positions, theta)
  k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, G, S, K], the cache's layout
  if ctx.cache is not None:
    k, v = ctx.cache.update(k, v, layer_idx)
  h, g, kd = q.shape[2], k.shape[1], q.shape[3]
  q = q.reshape(b, t, g, h // g, kd)
  scores = torch.einsum('btgqk,bgsk->bgqts', q.float(), k.float()) / math.sqrt(kd)
  mask = ctx.mask(k.shape[2])  # [B, T, S]
  scores = scores.masked_fill(~mask[:, None, None], torch.finfo(torch.float32).min)
  probs = torch.softmax(scores, dim=-1).to(v.dtype)
  out = torch.einsum('bgqts,bgsk->btgqk', probs, v).reshape(b, t, h, kd)
  return torch.einsum('bthk,hkd->btd', out, w['o'])


class DenseMLP(nn.Module):
  """SwiGLU: (silu(x gate) * (x up)) down."""

  def __init__(self, d, width):
    super().__init__()
    self.gate = nn.Parameter(torch.empty(d, width))
    self.up = nn.Parameter(torch.empty(d, width))
    self.down = nn.Parameter(torch.empty(width, d))

  def forward(self, x):
    return (F.silu(x @ self.gate) * (x @ self.up)) @ self.down


class MoE(nn.Module):
  """Routed SwiGLU experts (dropless) plus the always-on shared experts, if any."""

  def __init__(self, config, experts):
    super().__init__()
    c, d, f = config, config.hidden_size, config.expert_width
    self.config = c
    self.router = nn.Parameter(torch.empty(d, experts))
    self.gate = nn.Parameter(torch.empty(experts, d, f))
    self.up = nn.Parameter(torch.empty(experts, d, f))
    self.down = nn.Parameter(torch.empty(experts, f, d))
    if c.num_shared_experts:
      self.shared = DenseMLP(d, c.num_shared_experts * c.shared_expert_width)

  def route(self, x, bias):
    """(experts [T, k], weights [T, k]) of the tokens x [T, D]."""
    c = self.config
    logits = x.float() @ self.router.float()
    sigmoid = c.router_score == 'sigmoid'
    probs = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    select = probs if bias is None else probs + bias.float()
    if c.max_expert_devices:
      select = limit_groups(select, c.num_experts_per_tok, c.max_expert_devices, c.expert_devices)
    experts = torch.topk(select, c.num_experts_per_tok, dim=-1).indices
    weights = probs.gather(-1, experts)
    if c.renormalize or sigmoid:
      weights = weights / weights.sum(-1, keepdim=True)
    return experts, weights

  def forward(self, x, bias=None):
    b, t, d = x.shape
    xt = x.reshape(b * t, d)
    experts, weights = self.route(xt, bias)
    y = torch.zeros(b * t, d, dtype=torch.float32, device=x.device)
    for e in range(self.router.shape[1]):
      tok, slot = torch.nonzero(experts == e, as_tuple=True)
      if tok.numel():
        xe = xt[tok]
        h = F.silu(xe @ self.gate[e]) * (xe @ self.up[e])
        h = h * weights[tok, slot, None].to(h.dtype)
        y.index_add_(0, tok, (h @ self.down[e]).float())
    y = y.to(x.dtype).reshape(b, t, d)
    return y + self.shared(x) if hasattr(self, 'shared') else y


def limit_groups(select, top_k, max_groups, groups):
  """Device-limited routing: the experts outside a token's best `max_groups` of `groups`
  contiguous expert groups (a group scored by the sum of its ceil(k / M) highest scores)
  get -inf."""
  t, e = select.shape
  per = select.reshape(t, groups, e // groups)
  best = min(-(-top_k // max_groups), e // groups)
  score = per.topk(best, dim=-1).values.sum(-1)
  chosen = score.topk(max_groups, dim=-1).indices
  allowed = torch.zeros(t, groups, dtype=torch.bool, device=select.device).scatter_(1, chosen, True)
  return select.masked_fill(~allowed.repeat_interleave(e // groups, dim=1), -math.inf)


class Layer(nn.Module):
  """Pre-norm attention + feed-forward, each write scaled by `scale` (1/r inside the core)."""

  def __init__(self, config, experts, own_attention=True):
    super().__init__()
    self.theta = config.rope_theta
    if own_attention:
      self.attn = AttentionWeights(config)
    self.attn_norm, self.mlp_norm = Norm(config), Norm(config)
    if experts:
      self.moe = MoE(config, experts)
    else:
      self.mlp = DenseMLP(config.hidden_size, config.expert_width)

  def forward(self, x, ctx, layer_idx, attn_w=None, bias=None, scale=1.0):
    w = self.attn.weights() if attn_w is None else attn_w
    x = x + scale * attention(self.attn_norm(x), w, ctx, layer_idx, self.theta)
    u = self.mlp_norm(x)
    h = self.moe(u, bias) if hasattr(self, 'moe') else self.mlp(u)
    return x + scale * h


class Stack(nn.Module):
  """`layers` layers (layer_0, ...); the core's body also holds the injection's 'inject'
  [2, D, D] with injection 'concat'."""

  def __init__(self, config, layers, experts, own_attention=True, inject=False):
    super().__init__()
    for i in range(layers):
      self.add_module(f'layer_{i}', Layer(config, experts, own_attention))
    self.num_layers = layers
    if inject:
      d = config.hidden_size
      self.inject = nn.Parameter(torch.empty(2, d, d))

  def forward(self, x, ctx, first_idx, pass_attn=None, bias=None, scale=1.0):
    for i in range(self.num_layers):
      layer = getattr(self, f'layer_{i}')
      x = layer(x, ctx, first_idx + i, None if pass_attn is None else pass_attn[i],
                None if bias is None else bias[i], scale)
    return x


class Core(nn.Module):
  """The shared core: 'body' (its layers) and, with per-pass attention, pass_attn_<i>."""

  def __init__(self, config):
    super().__init__()
    c = self.config = config
    self.body = Stack(c, c.core_layers, c.core_experts, c.tie_attention,
                      c.injection == 'concat')
    if not c.tie_attention:
      for i in range(c.core_layers):
        self.add_module(f'pass_attn_{i}', AttentionWeights(c, stack=c.trained_loops))

  def forward(self, x, ctx, first_idx, num_loops, bias=None):
    c = self.config
    scale = 1.0
    if c.residual_scale == 'inverse_loops':
      scale = 1.0 / (num_loops if c.scale_passes == 'executed' else c.trained_loops)
    e = x
    for l in range(num_loops):
      if c.injection == 'add':
        x = x + e
      elif c.injection == 'concat':
        w = self.body.inject
        x = x @ w[0] + e @ w[1]
      attn = None if c.tie_attention else [getattr(self, f'pass_attn_{i}').weights(l)
                                           for i in range(c.core_layers)]
      pass_bias = bias if bias is None or bias.dim() == 2 else bias[min(l, bias.shape[0] - 1)]
      x = self.body(x, ctx, first_idx + l * c.core_layers, attn, pass_bias, scale)
    return x


class Context:
  """What every attention call of one forward shares: positions [B, T], the cache, and the
  key mask [B, T, S] (causal by slot, and the 2-D attention_mask's padding)."""

  def __init__(self, positions, cache, attention_mask, past):
    self.positions, self.cache, self.mask_2d, self.past = positions, cache, attention_mask, past

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

  def bias(self, seg):
    """The trained router bias of segment `seg`, or None."""
    return getattr(self.router_bias, seg, None) if hasattr(self, 'router_bias') else None

  def forward(self, input_ids, ctx, num_loops):
    c = self.config
    x = F.embedding(input_ids, self.embed)
    idx = 0
    if c.prelude_layers:
      x = self.prelude(x, ctx, 0, bias=self.bias('prelude'))
      idx = c.prelude_layers
    if c.core_layers:
      x = self.core(x, ctx, idx, num_loops, self.bias('core'))
      idx += c.core_layers * num_loops
    if c.coda_layers:
      x = self.coda(x, ctx, idx, bias=self.bias('coda'))
    x = self.final_norm(x)
    head = self.embed.t() / math.sqrt(c.hidden_size) if c.tie_embeddings else self.head
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


def prepare_cache(cache, num_loops, layers):
  """`cache` ready for a forward of `num_loops` passes over `layers` executed layers: one
  filled at another pass count is refused (its entries belong to other passes)."""
  past = cache.get_seq_length()
  made = getattr(cache, 'loopmoe_num_loops', None)
  if past and made is not None and made != num_loops:
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
              past_key_values=None, labels=None, use_cache=None, num_loops=None, **kwargs):
    """Logits [B, T, V] (float32) at `num_loops` passes; `cache` (or `past_key_values`) a
    transformers Cache of earlier tokens (one entry per executed pass and layer); a 2-D
    `attention_mask` masks padded keys and gives the positions when `position_ids` is None."""
    del kwargs  # output_attentions, return_dict, ...: nothing else is returned
    c = self.config
    n = check_loops(c, num_loops)
    cache = cache if cache is not None else past_key_values
    use_cache = c.use_cache if use_cache is None else use_cache
    if use_cache and cache is None:
      cache = DynamicCache()
    b, t = input_ids.shape
    past = prepare_cache(cache, n, c.prelude_layers + c.core_layers * n + c.coda_layers) if (
        cache is not None) else 0
    if attention_mask is not None and attention_mask.shape[-1] != past + t:  # 2-D only
      raise ValueError(f'attention_mask covers {attention_mask.shape[-1]} positions: the cache '
                       f'holds {past} and input_ids adds {t}')
    if position_ids is None:
      if attention_mask is not None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
      else:
        position_ids = (torch.arange(t, device=input_ids.device) + past)[None].expand(b, t)
    ctx = Context(position_ids, cache, attention_mask, past)
    logits = self.model(input_ids, ctx, n)
    loss = None
    if labels is not None:
      loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                             labels[:, 1:].reshape(-1), ignore_index=-100)
    return CausalLMOutputWithPast(loss=loss, logits=logits,
                                  **{_CACHE_FIELD: cache if use_cache else None})
