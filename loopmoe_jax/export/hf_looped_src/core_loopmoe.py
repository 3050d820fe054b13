"""The looped core of a loopmoe_jax export and its per-token early exit, in plain PyTorch.

The core's layers (one Stack, its weights shared) run `num_loops` times; `injection` adds (or
with 'concat' projects) the core's input at every pass; with `tie_attention` False each pass
has its own attention (`pass_attn_<i>`, a leading pass axis).

Early exit (config.exit, as loopmoe_jax's decoder applies it): a token stops looping once its
rule fires after a pass, and its state is frozen from then on (later passes run, masked, for
the others; when every token has exited the remaining passes are skipped). What a rule reads
of a state h: the final RMSNorm of h ('pass 0' is the core's input).
- 'gate' (a learned gate): lambda = sigmoid(w . norm(h) + b) after each pass; a token exits
  once its cumulative exit probability sum_t lambda_t prod_{j<t} (1 - lambda_j) reaches
  exit_threshold.
- 'kl' (no training): a token exits after pass p when KL(P_p || P_{p-1}) < exit_threshold,
  P_p = softmax(norm(h_p) @ head).
KV cache: a skipped pass writes nothing for a token; after the forward, the cache entries of
the passes a token skipped (at this forward's positions) hold the K/V of its last computed
pass (`fill_skipped`), so later tokens attending at a skipped pass read that pass's K/V.
Inside one forward of several tokens, later tokens attending at a pass an earlier token
skipped read the K/V computed from its frozen state.
"""
import torch
from torch import nn

from .layers_loopmoe import AttentionWeights, Stack, rms_norm


class Readout:
  """What the exit rules read: the rule, its threshold, the final norm's gain (or None) and
  eps, the head [D, V] in float32 ('kl') and the gate's w [D] and b [1] ('gate')."""

  def __init__(self, rule, threshold, gain, eps, head=None, gate_w=None, gate_b=None):
    self.rule, self.threshold, self.gain, self.eps = rule, threshold, gain, eps
    self.head, self.gate_w, self.gate_b = head, gate_w, gate_b

  def logprobs(self, x):
    """log P of states x [B, T, D]: log_softmax(norm(x) @ head), float32 [B, T, V]."""
    return torch.log_softmax(rms_norm(x, self.gain, self.eps) @ self.head, dim=-1)

  def exit_probability(self, x):
    """The gate's lambda [B, T] of states x [B, T, D]."""
    h = rms_norm(x, self.gain, self.eps)
    return torch.sigmoid(h @ self.gate_w.float() + self.gate_b.float())


class ExitState:
  """One forward's exit state: the tokens that exited, the passes each ran, and the rule's
  running value (the last pass's log-probabilities, or the cumulative exit probability)."""

  def __init__(self, readout, x):
    self.readout = readout
    bt, device = x.shape[:2], x.device
    self.exited = torch.zeros(bt, dtype=torch.bool, device=device)
    self.passes = torch.zeros(bt, dtype=torch.long, device=device)
    if readout.rule == 'kl':
      self.logp = readout.logprobs(x)
    else:
      self.cdf = torch.zeros(bt, dtype=torch.float32, device=device)
      self.survive = torch.ones(bt, dtype=torch.float32, device=device)

  def update(self, y):
    """After a pass whose (masked) output is y [B, T, D]."""
    r = self.readout
    self.passes = self.passes + (~self.exited).long()
    if r.rule == 'kl':
      logp = r.logprobs(y)
      fire = torch.sum(torch.exp(logp) * (logp - self.logp), dim=-1) < r.threshold
      self.logp = logp
    else:
      lam = r.exit_probability(y)
      self.cdf = self.cdf + lam * self.survive
      self.survive = self.survive * (1.0 - lam)
      fire = self.cdf >= r.threshold
    self.exited = self.exited | fire


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

  def scale(self, num_loops):
    """The factor on every write inside the core (1/r with residual_scale 'inverse_loops')."""
    c = self.config
    if c.residual_scale != 'inverse_loops':
      return 1.0
    return 1.0 / (num_loops if c.scale_passes == 'executed' else c.trained_loops)

  def one_pass(self, x, e, ctx, first_idx, index, bias, scale):
    """Pass `index` (0-based) of states x [B, T, D], `e` the core's input."""
    c = self.config
    if c.injection == 'add':
      x = x + e
    elif c.injection == 'concat':
      w = self.body.inject
      x = x @ w[0] + e @ w[1]
    attn = None if c.tie_attention else [getattr(self, f'pass_attn_{i}').weights(index)
                                         for i in range(c.core_layers)]
    pass_bias = bias if bias is None or bias.dim() == 2 else bias[min(index, bias.shape[0] - 1)]
    return self.body(x, ctx, first_idx + index * c.core_layers, attn, pass_bias, scale)

  def forward(self, x, ctx, first_idx, num_loops, bias=None, readout=None):
    """States after `num_loops` passes; with a `readout`, each token's exit applied."""
    c, scale, e = self.config, self.scale(num_loops), x
    state = None if readout is None else ExitState(readout, x)
    for index in range(num_loops):
      if state is not None and bool(state.exited.all()):
        hold_slots(ctx, first_idx + index * c.core_layers, c, x)  # the pass is skipped
        continue
      y = self.one_pass(x, e, ctx, first_idx, index, bias, scale)
      if state is not None:
        y = torch.where(state.exited[..., None], x, y)  # exited tokens keep their state
        state.update(y)
      x = y
    passes = None if state is None else state.passes
    if ctx.shared is not None:
      ctx.shared.keep(ctx.cache, passes)
    elif passes is not None and ctx.cache is not None:
      fill_skipped(ctx.cache, first_idx, c.core_layers, num_loops, passes, ctx.past)
    return x


def hold_slots(ctx, first_idx, config, x):
  """Cache entries for a skipped pass's layers (zeros; `fill_skipped` overwrites them)."""
  if ctx.cache is None or ctx.shared is not None:
    return
  b, t = x.shape[:2]
  shape = (b, config.num_key_value_heads, t, config.head_dim)
  for i in range(config.core_layers):
    zeros = torch.zeros(shape, dtype=x.dtype, device=x.device)
    ctx.cache.update(zeros, zeros.clone(), first_idx + i)


def last_computed(stacked, passes_BT, passes):
  """For each pass p in `passes` (a list of ints), every token's entry of pass
  min(p, its passes run - 1): the pass it last computed where it skipped p. `stacked`
  [P, B, G, T, K] holds the passes that ran, in order; returns [len(passes), B, G, T, K]."""
  index = torch.minimum(torch.tensor(passes, device=passes_BT.device)[:, None, None],
                        passes_BT[None] - 1).clamp(max=stacked.shape[0] - 1)  # [len, B, T]
  return torch.gather(stacked, 0, index[:, :, None, :, None].expand(
      (len(passes),) + stacked.shape[1:]))


def fill_skipped(cache, first_idx, layers, num_loops, passes_BT, past):
  """The cache entries of every pass a token skipped (pass index >= its passes run), at this
  forward's positions [past, past + T), set to its last computed pass's K/V."""
  t = passes_BT.shape[1]
  if bool((passes_BT >= num_loops).all()):  # no token skipped a pass: nothing to fill
    return
  for i in range(layers):
    entries = [cache.layers[first_idx + p * layers + i] for p in range(num_loops)]
    for name in ('keys', 'values'):
      win = torch.stack([getattr(e, name)[:, :, past:past + t] for e in entries])  # [P,B,G,T,K]
      new = last_computed(win, passes_BT, list(range(num_loops)))
      for p, entry in enumerate(entries):
        getattr(entry, name)[:, :, past:past + t] = new[p]


class SharedKV:
  """The core's KV cache under a shared layout (config.kv_cache 'last_pass' or 'first_pass',
  as loopmoe_jax's decode keeps it): one cache entry per core layer, after the prelude's,
  the coda's after them. In a forward of the tokens at positions [s, e), pass p at core layer
  l attends to the entry's K/V of positions < s and to pass p's own K/V of this forward;
  after the core, the entry gets this forward's K/V of the last pass (or of the first), a
  token that exited before it giving its last computed pass's."""

  def __init__(self, layout, first_idx, layers, num_loops):
    self.keep_pass = num_loops - 1 if layout == 'last_pass' else 0
    self.first, self.layers, self.num_loops = first_idx, layers, num_loops
    self.end = first_idx + layers * num_loops  # executed layers past the core
    self.step = {}  # (pass, core layer) -> this forward's (k, v)

  def attend(self, cache, k, v, layer_idx, past):
    """The keys and values [B, G, S, K] executed layer `layer_idx` attends to."""
    if layer_idx < self.first:
      return cache.update(k, v, layer_idx)
    if layer_idx >= self.end:  # the coda
      return cache.update(k, v, layer_idx - self.layers * (self.num_loops - 1))
    index, i = divmod(layer_idx - self.first, self.layers)
    self.step[(index, i)] = (k, v)
    if not past:
      return k, v
    entry = cache.layers[self.first + i]
    return (torch.cat([entry.keys[:, :, :past], k], dim=2),
            torch.cat([entry.values[:, :, :past], v], dim=2))

  def keep(self, cache, passes_BT=None):
    """The kept pass's K/V of this forward into each core entry (`passes_BT`: the passes each
    token ran under early exit, or None)."""
    for i in range(self.layers):
      ran = [self.step[(p, i)] for p in range(self.num_loops) if (p, i) in self.step]
      k, v = ran[min(self.keep_pass, len(ran) - 1)]
      if passes_BT is not None and self.keep_pass:  # last_pass: a token's last computed pass
        pick = lambda j: last_computed(torch.stack([r[j] for r in ran]), passes_BT,
                                       [self.keep_pass])[0]
        k, v = pick(0), pick(1)
      cache.update(k, v, self.first + i)
