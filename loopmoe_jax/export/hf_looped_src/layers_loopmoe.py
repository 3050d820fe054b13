"""The layers of a looped Mixture-of-Experts causal LM exported by loopmoe_jax, in plain
PyTorch: RMSNorm, RoPE (rotate-half), causal attention through the transformers cache, the
dense and routed SwiGLU feed-forwards, and pre-norm layers stacked. Parameters in loopmoe_jax's
layouts (q/k/v [D, heads, K], o [H, K, D], router [D, E], experts [E, D, F] / [E, F, D])."""
import math

import torch
import torch.nn.functional as F
from torch import nn


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
  """Causal attention of x [B, T, D] with weights `w`; K/V go through the cache
  (`ctx.kv`, executed layer `layer_idx`) when ctx.cache is set. Scores and softmax in
  float32."""
  b, t, _ = x.shape
  q = torch.einsum('btd,dhk->bthk', x, w['q'])
  k = torch.einsum('btd,dgk->btgk', x, w['k'])
  v = torch.einsum('btd,dgk->btgk', x, w['v'])
  q, k = rope(q, ctx.positions, theta), rope(k, ctx.positions, theta)
  k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, G, S, K], the cache's layout
  if ctx.cache is not None:
    k, v = ctx.kv(k, v, layer_idx)
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
        y[tok] += (h @ self.down[e]).float()  # a token picks an expert once: rows unique
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
