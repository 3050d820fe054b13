"""Batched generation of prompts of different lengths, each row what it would be alone.

    outs = generate_batch(cfg, params, [[5, 7, 9], [3], ...], max_new=64, key=key,
                          sampling=Sampling(0.8, top_k=40), stop_tokens=(10,), batch_size=8)
    outs[i].tokens     # prompt i's continuation (cut after its first stop token, kept)

Rows run natively batched: one cache whose 'position' holds a position per row, so a row's
prompt sits at positions 0 .. n_i - 1 with its RoPE, its causal mask and its cache writes
exactly where a single-prompt decode puts them (attention.write_rows; a per-token exit fills
the skipped passes' slots at each row's own positions). The MoE routes every token on its
own when dropless; under model.capacity_factor, where the capacity counts the batch's
tokens, each row runs as its own batch (decode_step vmapped over per-row caches). Prompts
are right-padded to the batch's longest: the prefill writes the pad tokens' K/V after a
row's last prompt token, where the causal mask hides them from the row's queries (a query
sees positions up to its own) and the decode steps overwrite them. The row's first token is
read at its own last prompt position, and its position set to n_i.

Randomness is per prompt: prompt i (its index in `prompts`, or `prompt_ids[i]`) draws step j with
fold_in(fold_in(key, i), j), so its sampled text does not depend on the batch it runs in or
the batch size (tests/test_batched_generate.py checks rows against single-prompt runs).
A batch stops when every row has emitted a stop token or `max_new` tokens.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.decode import decode_step, init_cache, slots_for
from loopmoe_jax.model import check_loops
from loopmoe_jax.runtime import HERE, Runtime
from loopmoe_jax.sampling import GREEDY, Sampling

PAD_TO = 8  # prompts pad to a multiple of this: fewer programs over a file of prompts


class Generated(NamedTuple):
  """One prompt's result: `tokens`, its continuation (after the prompt, up to and including
  the first stop token) and `stopped`, whether a stop token ended it."""
  tokens: list[int]
  stopped: bool


def generate_batch(cfg: ModelConfig, params, prompts: Sequence[Sequence[int]], max_new: int,
                   key, sampling: Sampling = GREEDY, stop_tokens: Sequence[int] = (),
                   batch_size: int = 8, num_loops: int | None = None, router_bias=None,
                   runtime: Runtime = HERE,
                   prompt_ids: Sequence[int] | None = None) -> list[Generated]:
  """Continuations of every prompt (lists of token ids, any lengths), `batch_size` prompts a
  program run, in the order given (module docstring). `prompt_ids`: the numbers folded into
  `key` per prompt (default its index): a prompt run alone with its id draws what it draws in
  any batch."""
  check_loops(cfg, num_loops)
  if max_new < 1:
    raise ValueError(f'max_new={max_new}: must be >= 1')
  if batch_size < 1:
    raise ValueError(f'batch_size={batch_size}: must be >= 1')
  lengths = [len(p) for p in prompts]
  if not prompts or min(lengths) < 1:
    raise ValueError('generate_batch: every prompt needs at least one token')
  ids = list(range(len(prompts)) if prompt_ids is None else prompt_ids)
  if len(ids) != len(prompts):
    raise ValueError(f'prompt_ids: {len(ids)} ids for {len(prompts)} prompts')
  stops = jnp.asarray(list(stop_tokens) or [-1], jnp.int32)
  out: list[Generated] = []
  for lo in range(0, len(prompts), batch_size):
    rows = list(prompts[lo:lo + batch_size])
    width = -(-max(len(p) for p in rows) // PAD_TO) * PAD_TO
    padded = np.zeros((len(rows), width), np.int32)
    for i, p in enumerate(rows):
      padded[i, :len(p)] = p
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(ids[lo:lo + len(rows)]))
    toks = np.asarray(_program(cfg, params, jnp.asarray(padded),
                               jnp.asarray([len(p) for p in rows], jnp.int32), keys, max_new,
                               sampling, num_loops, router_bias, runtime, stops))
    out.extend(_cut(row, set(stop_tokens)) for row in toks)
  return out


def _cut(row, stops: set[int]) -> Generated:
  """A row's tokens up to and including its first stop token."""
  for i, t in enumerate(row.tolist()):
    if t in stops:
      return Generated(row[:i + 1].tolist(), True)
  return Generated(row.tolist(), False)


@functools.partial(jax.jit, static_argnames=('cfg', 'max_new', 'sampling', 'num_loops',
                                             'runtime'))
def _program(cfg: ModelConfig, params, prompts_BN, lengths_B, keys_B, max_new: int,
             sampling: Sampling, num_loops, router_bias, runtime: Runtime, stops):
  """One batch: the rows' prefill and decode steps (`_stepper`); returns the continuations
  [B, max_new] (past a row's stop token: unspecified)."""
  batch, width = prompts_BN.shape
  caches, step = _stepper(cfg, params, batch, slots_for(cfg, runtime, width + max_new),
                          num_loops, router_bias, runtime)
  logits_BNV, caches = step(caches, prompts_BN, True)  # the prefill: an empty cache
  last_BV = jnp.take_along_axis(logits_BNV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
  caches = {**caches, 'position': lengths_B.reshape(caches['position'].shape)}
  draw = jax.vmap(lambda logits_V, key, j: sampling.sample(logits_V, jax.random.fold_in(key, j)),
                  in_axes=(0, 0, None))
  first = draw(last_BV, keys_B, 0)
  out = jnp.zeros((batch, max_new), jnp.int32).at[:, 0].set(first)

  def body(state):
    caches, out, tok, j, done = state
    logits, caches = step(caches, tok[:, None])
    nxt = draw(logits[:, -1], keys_B, j)
    out = out.at[:, j].set(nxt)
    return caches, out, nxt, j + 1, done | jnp.isin(nxt, stops)

  state = (caches, out, first, jnp.ones((), jnp.int32), jnp.isin(first, stops))
  _, out, *_ = jax.lax.while_loop(lambda s: (s[3] < max_new) & ~jnp.all(s[4]), body, state)
  return out


def _stepper(cfg: ModelConfig, params, batch: int, max_len: int, num_loops, router_bias,
             runtime: Runtime):
  """(caches, step): step(caches, tokens_BT, empty=False) -> (logits_BTV, caches) feeds every
  row at its own position (`empty`: the prefill, decode_step's empty_cache). Natively
  batched: one cache with a position per row. Under
  model.capacity_factor the MoE's capacity counts the batch's tokens, so each row runs as
  its own batch instead (decode_step vmapped over per-row caches of batch 1)."""
  if not cfg.capacity_factor:
    cache = {**init_cache(cfg, batch, max_len, num_loops),
             'position': jnp.zeros((batch,), jnp.int32)}
    return cache, lambda c, t, empty=False: decode_step(cfg, params, c, t, num_loops,
                                                        router_bias, runtime, empty)
  one = init_cache(cfg, 1, max_len, num_loops)
  caches = jax.tree.map(lambda x: jnp.broadcast_to(x, (batch,) + x.shape), one)

  def row(cache, tokens_T, empty):  # one row as a batch of one: logits [T, V]
    logits_1TV, cache = decode_step(cfg, params, cache, tokens_T[None], num_loops,
                                    router_bias, runtime, empty)
    return logits_1TV[0], cache
  return caches, lambda c, t, empty=False: jax.vmap(functools.partial(row, empty=empty))(c, t)
