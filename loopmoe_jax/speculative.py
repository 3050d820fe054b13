"""Self-speculative decoding whose draft is the model's own first passes (loop-draft).

    out = generate_speculative(cfg, params, prompt_1T, steps=64, key=key, draft_loops=1,
                               lookahead=4)                       # greedy: plain greedy's tokens
    out.tokens, out.stats   # [1, P + steps]; {'rounds', 'drafted', 'accepted', ...}

A looped model runs its core L times per token. Under the 'per_pass' KV cache the first d
passes of a new token compute exactly what the full model computes in those passes (same
weights, same inputs, the same pass-p K/V of every earlier position), so a draft of d passes
is the full forward's beginning, and verification starts at pass d. One round, from the
pending token x at position s (sampled, not yet fed):

1. Draft g = `lookahead` tokens one at a time: each fed token runs the prelude, passes
   [0, d), the coda and the head (pass_range.run_front + run_readout), and the next drafted
   token is drawn from those logits (q). The last drafted token is fed through the prelude and
   passes [0, d) only. The g + 1 fed tokens' states after pass d and the core's injected input
   are kept; their cache slots of the prelude and of passes < d are already the full model's.
2. Verify: passes [d, L), the coda and the head over the g + 1 kept states in one chunk
   (pass_range.run_back): the full model's logits p at positions s .. s + g, and the full
   model's slots of passes >= d and of the coda at those positions (overwriting the draft's
   coda slots).
3. Accept (sampling.accept_draft): the longest prefix of drafted tokens that the rule keeps,
   then one more token (the target's at the first rejection, or after the last drafted one):
   greedy keeps a drafted token when it is the target's argmax, so the output is plain greedy
   decoding's; sampling keeps y with probability min(1, p(y)/q(y)) and draws a rejection from
   norm(max(0, p - q)), so every token is distributed as the full model's.
4. Roll back: the position moves to s + n + 1. Slots past it hold rejected tokens' K/V; the
   causal mask hides every slot past a query's position and the next rounds overwrite them,
   so nothing is copied.

A round costs g + 1 fronts (d passes each), g readouts and one back of L - d passes over
g + 1 positions, and emits n + 1 tokens (`Stats`: acceptance rate, passes per token).

What holds exactly, and what is refused (check_speculative, one line naming the key):
- model.kv_cache 'last_pass' / 'first_pass': a shared slot holds one pass's K/V, so a drafted
  token's passes < d would read the earlier drafted tokens' slot before the verifier has made
  it ('last_pass'), and the verifier's chunk reads its own earlier positions at pass p where
  one-token decoding reads pass 0's ('first_pass', decode.py): neither is the plain decode.
  Refused; 'per_pass' decodes any model exactly (the layout is a decoding option).
- model.exit 'kl' / 'gate': the passes a token runs depend on its exit, and skipped passes'
  slots hold another pass's K/V: the draft is not the full model's beginning. Refused; decode
  with model.exit='none' or without --speculative.
- model.capacity_factor > 0: an expert's capacity depends on the tokens in the chunk, so the
  verifier's chunk can drop what one-token decoding keeps. Refused.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.decode import decode_step, init_cache, slots_for
from loopmoe_jax.model import check_loops
from loopmoe_jax.pass_range import PassForward, run_back, run_front, run_readout
from loopmoe_jax.runtime import HERE, Runtime
from loopmoe_jax.sampling import GREEDY, Sampling, accept_draft


def check_speculative(cfg: ModelConfig, num_loops: int | None, draft_loops: int,
                      lookahead: int) -> int:
  """The pass count L of a speculative decode, or a ValueError naming the setting that the
  loop-draft cannot serve exactly and what would work (module docstring)."""
  loops = check_loops(cfg, num_loops)
  if not cfg.core_layers:
    raise ValueError('model.core_layers=0: the loop-draft drafts with core passes; decode '
                     'without --speculative')
  if not 0 <= draft_loops < loops:
    raise ValueError(f'draft_loops={draft_loops}: must lie in [0, {loops}) (the draft runs '
                     f'fewer passes than the {loops} it is verified with)')
  if lookahead < 1:
    raise ValueError(f'lookahead={lookahead}: must be >= 1 (tokens drafted per round)')
  if cfg.kv_cache != 'per_pass':
    raise ValueError(f'model.kv_cache={cfg.kv_cache!r}: a shared slot does not keep the pass-d '
                     "K/V the draft and the verifier read; speculative decoding is exact under "
                     "model.kv_cache='per_pass' (--kv_cache=per_pass)")
  if cfg.exit != 'none':
    raise ValueError(f'model.exit={cfg.exit!r}: per-token exits make the passes a token runs '
                     "depend on its exit; decode with model.exit='none' or without "
                     '--speculative')
  if cfg.capacity_factor:
    raise ValueError(f'model.capacity_factor={cfg.capacity_factor}: the verifier\'s chunk can '
                     'drop assignments that one-token decoding keeps; speculative decoding is '
                     'exact with model.capacity_factor=0 (dropless)')
  return loops


class Speculated(NamedTuple):
  """generate_speculative's result: `tokens` [1, P + steps] (prompt then continuation; with
  stop tokens, positions past the first stop are unspecified: cut with `length`), `length`
  (the tokens emitted, <= steps) and `stats` (Stats's counters, device scalars)."""
  tokens: jax.Array
  length: jax.Array
  stats: dict


def stats_summary(stats, draft_loops: int, lookahead: int, loops: int) -> dict[str, float]:
  """Per-token figures of a decode's counters: `acceptance` (drafted tokens kept over drafted),
  `tokens_per_round`, `verified_passes_per_token` (the verifier's sequential passes, L - d a
  round, per emitted token: plain decoding runs L) and `passes_per_token` (every pass run in
  sequence, the draft's (g + 1) d and the verifier's L - d a round, per emitted token)."""
  rounds, emitted = float(stats['rounds']), max(float(stats['emitted']), 1.0)
  accepted, drafted = float(stats['accepted']), max(float(stats['drafted']), 1.0)
  per_round = (lookahead + 1) * draft_loops + loops - draft_loops
  return {'acceptance': accepted / drafted, 'tokens_per_round': emitted / max(rounds, 1.0),
          'verified_passes_per_token': rounds * (loops - draft_loops) / emitted,
          'passes_per_token': rounds * per_round / emitted}


def _draft_block(pf: PassForward, cache, tok, start, draft_loops, lookahead: int,
                 sampling: Sampling, key):
  """Step 1 of a round (module docstring): (cache, drafted [g], draft logits [g, V], states
  after pass d [1, g + 1, D], injected inputs [1, g + 1, D])."""
  def step(carry, i):
    cache, tok = carry
    front = run_front(pf, cache, tok[None, None], start + i, draft_loops)
    logits, cache = run_readout(pf, front.cache, front.h_BTD, start + i)
    nxt = sampling.sample(logits[0, 0], jax.random.fold_in(key, i))
    return (cache, nxt), (nxt, logits[0, 0], front.h_BTD[0, 0], front.e_BTD[0, 0])

  (cache, last), (drafted, q_logits, h, e) = jax.lax.scan(step, (cache, tok),
                                                          jnp.arange(lookahead))
  front = run_front(pf, cache, last[None, None], start + lookahead, draft_loops)
  h = jnp.concatenate([h, front.h_BTD[0]], axis=0)[None]
  e = jnp.concatenate([e, front.e_BTD[0]], axis=0)[None]
  return front.cache, drafted, q_logits, h, e


class _State(NamedTuple):
  cache: Any
  out: jax.Array       # [steps + g + 1] emitted tokens (a round writes g + 1; n + 1 count)
  emitted: jax.Array   # tokens emitted so far
  tok: jax.Array       # the pending token (emitted, not yet fed)
  pos: jax.Array       # its position
  key: jax.Array
  stopped: jax.Array   # a stop token was emitted
  stats: dict


def _round(pf: PassForward, state: _State, draft_loops, lookahead: int,
           sampling: Sampling, stops) -> _State:
  """One draft-verify-accept round (module docstring, steps 1-4)."""
  key, k_draft, k_accept = jax.random.split(state.key, 3)
  cache, drafted, q_logits, h, e = _draft_block(pf, state.cache, state.tok, state.pos,
                                                draft_loops, lookahead, sampling, k_draft)
  p_logits, cache = run_back(pf, cache, h, e, state.pos, draft_loops)
  n, nxt = accept_draft(sampling, p_logits[0], q_logits, drafted, k_accept)
  idx = jnp.arange(lookahead + 1)
  block = jnp.where(idx < n, jnp.concatenate([drafted, drafted[-1:]]), nxt)
  out = jax.lax.dynamic_update_slice(state.out, block, (state.emitted,))
  stopped = state.stopped | jnp.any(jnp.isin(block, stops) & (idx <= n))
  s = state.stats
  stats = {'rounds': s['rounds'] + 1, 'drafted': s['drafted'] + lookahead,
           'accepted': s['accepted'] + n, 'emitted': s['emitted'] + n + 1}
  return _State(cache, out, state.emitted + n + 1, nxt, state.pos + n + 1, key, stopped, stats)


def generate_speculative(cfg: ModelConfig, params, prompt_1T, steps: int, key, *,
                         draft_loops: int, lookahead: int, sampling: Sampling = GREEDY,
                         num_loops: int | None = None, router_bias=None,
                         runtime: Runtime = HERE, stop_tokens=None) -> Speculated:
  """Loop-draft speculative continuation of one prompt (batch 1): `draft_loops` = d passes
  draft, `lookahead` = g tokens a round, verified by the L-pass model (`num_loops`, default
  the trained count). Greedy (`sampling` GREEDY) gives decode.generate's greedy tokens;
  sampling gives the full model's distribution (module docstring). `stop_tokens`: int ids;
  decoding stops after the round that emits one. Refusals: check_speculative. One compiled
  program per (config, shapes, g, sampling) serves every d (a traced pass range)."""
  check_speculative(cfg, num_loops, draft_loops, lookahead)
  if prompt_1T.ndim != 2 or prompt_1T.shape[0] != 1:
    raise ValueError(f'generate_speculative decodes one prompt: shape [1, T], got '
                     f'{prompt_1T.shape} (batched.generate_batch serves batches)')
  if steps < 1:
    raise ValueError(f'steps={steps}: must be >= 1')
  stops = jnp.asarray([-1] if stop_tokens is None or not len(stop_tokens) else stop_tokens,
                      jnp.int32).reshape(-1)
  return _program(cfg, params, jnp.asarray(prompt_1T), steps, key,
                  jnp.asarray(draft_loops, jnp.int32), lookahead, sampling, num_loops,
                  router_bias, runtime, stops)


@functools.partial(jax.jit, static_argnames=('cfg', 'steps', 'lookahead', 'sampling',
                                             'num_loops', 'runtime'))
def _program(cfg: ModelConfig, params, prompt_1T, steps: int, key, draft_loops, lookahead: int,
             sampling: Sampling, num_loops, router_bias, runtime: Runtime, stops) -> Speculated:
  """generate_speculative's one program: the prefill (decode_step), the first token, then
  rounds until `steps` tokens are emitted or a stop token is."""
  loops = check_loops(cfg, num_loops)
  plen = prompt_1T.shape[1]
  cache = init_cache(cfg, 1, slots_for(cfg, runtime, plen + steps + lookahead + 1), loops)
  logits, cache = decode_step(cfg, params, cache, prompt_1T, loops, router_bias, runtime,
                              empty_cache=True)
  first = sampling.sample(logits[0, -1], jax.random.fold_in(key, 0))
  pf = PassForward.of(cfg, params, router_bias, runtime, loops)
  zero = jnp.zeros((), jnp.int32)
  out = jnp.zeros((steps + lookahead + 1,), jnp.int32).at[0].set(first)
  state = _State(cache, out, jnp.ones((), jnp.int32), first, jnp.asarray(plen, jnp.int32),
                 jax.random.fold_in(key, 1), jnp.isin(first, stops),
                 {'rounds': zero, 'drafted': zero, 'accepted': zero, 'emitted': zero + 1})
  state = jax.lax.while_loop(
      lambda st: (st.emitted < steps) & ~st.stopped,
      lambda st: _round(pf, st, draft_loops, lookahead, sampling, stops), state)
  tokens = jnp.concatenate([prompt_1T.astype(jnp.int32), state.out[None, :steps]], axis=1)
  return Speculated(tokens, jnp.minimum(state.emitted, steps), state.stats)
