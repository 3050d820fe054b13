"""Next-token sampling settings and the speculative acceptance rule.

    s = Sampling(temperature=0.8, top_k=40, top_p=0.95)
    probs_BV = s.probs(logits_BV)            # the distribution a token is drawn from
    tok_B = s.sample(logits_BV, key)         # argmax when temperature is 0 (greedy)

Every generator of the project (decode.generate's scan, batched.generate_batch,
speculative.generate_speculative) draws through `Sampling`, so "the model's distribution"
means one thing everywhere: softmax(logits / temperature), restricted to the `top_k` most
likely tokens and then to the smallest set whose probability reaches `top_p` (nucleus), and
renormalised.

The speculative acceptance rule (Leviathan et al. 2023, Chen et al. 2023): a drafted token y
drawn from the draft's distribution q is kept with probability min(1, p(y) / q(y)), p the
target's; on rejection a token is drawn from the residual norm(max(0, p - q)). The token
that comes out is distributed as p exactly: P(v) = q(v) min(1, p(v)/q(v)) + (1 - sum_u
min(p(u), q(u))) * residual(v) = min(p(v), q(v)) + max(0, p(v) - q(v)) = p(v).
`accept_probability`, `residual` and `output_distribution` are that rule as functions of the
probabilities (tests/test_speculative.py checks the output distribution against p on a
model's own p and q); `accept_draft` applies it to a drafted block.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How a token is drawn from logits: greedy at `temperature` 0, else from softmax(logits /
  temperature) restricted to the `top_k` most likely tokens (0: all) and the top-`top_p`
  nucleus (1.0: all). Hashable: a static argument of the jitted generators."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not (math.isfinite(self.temperature) and self.temperature >= 0):
      raise ValueError(f'temperature={self.temperature}: must be a finite number >= 0 '
                       '(0: greedy)')
    if self.top_k < 0:
      raise ValueError(f'top_k={self.top_k}: must be >= 0 (0: every token)')
    if not 0 < self.top_p <= 1:
      raise ValueError(f'top_p={self.top_p}: must lie in (0, 1] (1: every token)')

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  def log_probs(self, logits_BV):
    """Log-probabilities [.., V] (float32) of the distribution tokens are drawn from; -inf
    outside the top-k / top-p set. Greedy: a one-hot on the argmax."""
    logits = logits_BV.astype(jnp.float32)
    if self.greedy:
      hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.bool_)
      return jnp.where(hot, 0.0, -jnp.inf)
    logits = logits / self.temperature
    vocab = logits.shape[-1]
    if 0 < self.top_k < vocab:
      kth = jax.lax.top_k(logits, self.top_k)[0][..., -1:]
      logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if self.top_p < 1.0:
      order = jnp.argsort(-logits, axis=-1)
      sorted_p = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
      before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass of the more likely tokens
      keep_sorted = before < self.top_p                 # the first token always stays
      keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
      logits = jnp.where(keep, logits, -jnp.inf)
    return jax.nn.log_softmax(logits, axis=-1)

  def probs(self, logits_BV):
    """The distribution [.., V] tokens are drawn from (`log_probs` exponentiated)."""
    return jnp.exp(self.log_probs(logits_BV))

  def sample(self, logits_BV, key):
    """Token ids [..] (int32): the argmax when greedy, else a draw from `probs`."""
    if self.greedy:
      return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    if self.top_k == 0 and self.top_p == 1.0:  # decode.generate's draw since its first version
      return jax.random.categorical(key, logits_BV / self.temperature, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, self.log_probs(logits_BV), axis=-1).astype(jnp.int32)


GREEDY = Sampling()


def accept_probability(p_V, q_V, token):
  """min(1, p(y) / q(y)) of drafted token `token` (q(y) > 0: y was drawn from q)."""
  p_y, q_y = p_V[..., token], q_V[..., token]
  return jnp.minimum(1.0, p_y / jnp.maximum(q_y, jnp.finfo(jnp.float32).tiny))


def residual(p_V, q_V):
  """norm(max(0, p - q)): what a rejection draws from. Where p <= q everywhere (p == q up to
  rounding: a rejection then has probability ~0) it falls back to p."""
  r = jnp.maximum(p_V - q_V, 0.0)
  total = jnp.sum(r, axis=-1, keepdims=True)
  return jnp.where(total > 0, r / jnp.maximum(total, jnp.finfo(jnp.float32).tiny), p_V)


def output_distribution(p_V, q_V):
  """The exact distribution of the token the acceptance rule emits for one drafted position
  (y ~ q, kept with `accept_probability`, else a draw from `residual`), summed over every y:
  equal to p (the module docstring)."""
  vocab = p_V.shape[-1]
  kept = jnp.stack([q_V[..., y] * accept_probability(p_V, q_V, y) for y in range(vocab)], -1)
  return kept + (1.0 - jnp.sum(kept, axis=-1, keepdims=True)) * residual(p_V, q_V)


def accept_draft(sampling: Sampling, p_logits_GV, q_logits_GV, drafted_G, key):
  """The acceptance rule over a drafted block: (n, next) with n the drafted tokens kept (the
  longest accepted prefix) and `next` the token after them: the residual draw at the first
  rejection, or a draw from the target at position n when all were kept.

  `p_logits_GV` has one more row than the block (the target's logits after each drafted
  token and after the last); `q_logits_GV` the draft's, one per drafted token. Greedy: a
  drafted token is kept when it is the target's argmax, and `next` is the target's argmax at
  position n, so the output is greedy decoding's token for token."""
  g = drafted_G.shape[0]
  if sampling.greedy:
    target = jnp.argmax(p_logits_GV, axis=-1).astype(jnp.int32)
    n = jnp.sum(jnp.cumprod(target[:g] == drafted_G)).astype(jnp.int32)
    return n, target[n]
  p, q = sampling.probs(p_logits_GV), sampling.probs(q_logits_GV)
  k_accept, k_next = jax.random.split(key)
  rows = jnp.arange(g)
  ratio = jnp.minimum(1.0, p[rows, drafted_G] /
                      jnp.maximum(q[rows, drafted_G], jnp.finfo(jnp.float32).tiny))
  ok = jax.random.uniform(k_accept, (g,)) < ratio
  n = jnp.sum(jnp.cumprod(ok)).astype(jnp.int32)
  q_pad = jnp.concatenate([q, jnp.zeros_like(q[:1])], axis=0)  # row g: no draft, p itself
  dist = residual(p[n], q_pad[n])
  nxt = jax.random.categorical(k_next, jnp.log(dist)).astype(jnp.int32)
  return n, nxt
