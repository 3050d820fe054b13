"""The decoding forward cut at a core pass: prelude + passes [0, d), and passes [d, L) + coda +
head, over the model's own params and its 'per_pass' KV cache (decode.init_cache's tree).

    front = run_front(pf, cache, tokens_BT, start, d)      # embed, prelude, passes 0..d-1
    logits_BTV, cache = run_back(pf, front.cache, front.h_BTD, front.e_BTD, start, d)

`PassForward` holds what both halves read (config, params, router bias, runtime, the pass
count L). Together the two halves compute what decode_step computes for the chunk (the same
modules, core.Stack for every segment and pass, the same params, cache slots and positions):
the pass-p slot of every position is written by pass p, the coda's by the coda. Between them
travel the states after pass d (`h_BTD`) and the core's injected input (`e_BTD`, the
prelude's output, read by every pass under model.injection). Self-speculative decoding
(speculative.py) runs the front and a readout (`run_readout`: coda + norm + head) per drafted
token, and the back once over the drafted block.

Only model.kv_cache='per_pass' and model.exit='none' are served (speculative.check_speculative
says why the others are not); the cache's `position` is neither read nor written here: the
caller passes `start`, the position of the chunk's first token.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from loopmoe_jax import dispatch
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.core import ACTIVATION, Stack, residual_scale
from loopmoe_jax.layers import DTYPES, RMSNorm
from loopmoe_jax.model import check_loops, head_matrix
from loopmoe_jax.runtime import HERE, Runtime


@dataclasses.dataclass(frozen=True)
class PassForward:
  """What both halves of the cut forward read. `params`: the param tree (unboxed);
  `router_bias`: the {'bias': {segment: array}} collection of model.router_bias, or None;
  `loops`: the pass count L of the full forward (the trained count by default)."""
  cfg: ModelConfig
  params: Any
  router_bias: Any = None
  runtime: Runtime = HERE
  loops: int = 0

  @classmethod
  def of(cls, cfg: ModelConfig, params, router_bias=None, runtime: Runtime = HERE,
         num_loops: int | None = None) -> 'PassForward':
    params = nn.unbox(params)
    if 'params' in params:  # variables {'params': ..., 'router_bias': ...}
      router_bias = params.get('router_bias', router_bias)
      params = params['params']
    rt = dispatch.settle(runtime.resolved())
    return cls(cfg, params, router_bias, rt, check_loops(cfg, num_loops))

  def bias(self, segment: str):
    return None if self.router_bias is None else self.router_bias['bias'].get(segment)


class Front(NamedTuple):
  """The front half's outputs: the cache with the prelude's and passes [0, d)'s slots of the
  chunk written, the states after pass d and the core's injected input."""
  cache: Any
  h_BTD: jax.Array
  e_BTD: jax.Array


def _positions(start, batch: int, length: int):
  return jnp.broadcast_to(start + jnp.arange(length, dtype=jnp.int32), (batch, length))


def _apply_stack(pf: PassForward, stack: Stack, params, cache, x_BTD, pass_attn, e_BTD, pos_BT,
                 bias, pass_index=None):
  """One core.Stack forward in decode mode: (its output, its cache subtree). With
  `pass_index` the cache holds every pass's slots and that pass's are written in place."""
  (y_BTD, _), mutated = stack.apply({'params': params, 'cache': cache}, x_BTD, pass_attn, e_BTD,
                                    pos_BT, bias, pass_index, mutable=['cache'])
  return y_BTD, mutated['cache']


def _segment(pf: PassForward, name: str, layers: int, experts: int, cache, x_BTD, pos_BT):
  """The prelude or the coda (model._segments's stack of that name), its cache updated."""
  stack = Stack(pf.cfg, layers, experts, decode=True, runtime=pf.runtime)
  y, seg_cache = _apply_stack(pf, stack, pf.params[name], cache[name], x_BTD, None, None,
                              pos_BT, pf.bias(name))
  return y, {**cache, name: seg_cache}


def run_passes(pf: PassForward, cache, x_BTD, e_BTD, start, first, stop):
  """Core passes [first, stop) of the L-pass forward on states `x_BTD` (after pass `first`),
  as core.Core runs them: the shared Stack writing pass p's cache slot in place, its untied
  attention slice and per-pass router bias, the residual scale of L passes. `first` and
  `stop` may be traced (one program serves every cut: a loop over a dynamic range). Returns
  (states after pass `stop`, cache)."""
  c = pf.cfg
  stack = Stack(c, c.core_layers, c.core_experts, residual_scale(c, pf.loops), c.injection,
                decode=True, runtime=pf.runtime)
  pos_BT = _positions(start, x_BTD.shape[0], x_BTD.shape[1])
  core_p = pf.params['core']
  e_in = e_BTD if c.injection != 'none' else None
  at = lambda tree, p: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, p, 0, False), tree)

  def one_pass(p, carry):
    x, body = carry
    attn = None if c.tie_attention else [at(core_p[f'pass_attn_{i}'], p)
                                         for i in range(c.core_layers)]
    bias = pf.bias('core')
    if bias is not None and bias.ndim == 3:  # per pass; past the trained count the last one's
      bias = bias[jnp.minimum(p, bias.shape[0] - 1)]
    return _apply_stack(pf, stack, core_p['body'], body, x, attn, e_in, pos_BT, bias, p)

  x_BTD, body = jax.lax.fori_loop(first, stop, one_pass, (x_BTD, cache['core']['body']))
  return x_BTD, {**cache, 'core': {**cache['core'], 'body': body}}


def run_front(pf: PassForward, cache, tokens_BT, start, draft_loops: int) -> Front:
  """Embedding, prelude and core passes [0, draft_loops) of a chunk of tokens at positions
  [start, start + T): the model's forward up to the state after pass `draft_loops`."""
  c = pf.cfg
  table = pf.runtime.constrain(pf.params['embed'], ('vocab', None))
  x = pf.runtime.constrain(jnp.take(table, tokens_BT, axis=0).astype(DTYPES[c.dtype]),
                           ACTIVATION)
  pos_BT = _positions(start, tokens_BT.shape[0], tokens_BT.shape[1])
  if c.prelude_layers:
    x, cache = _segment(pf, 'prelude', c.prelude_layers, c.prelude_experts, cache, x, pos_BT)
  h, cache = run_passes(pf, cache, x, x, start, 0, draft_loops)
  return Front(cache, h, x)


def run_readout(pf: PassForward, cache, x_BTD, start):
  """Coda, final norm and head on states after the core: (logits_BTV float32, cache)."""
  c = pf.cfg
  if c.coda_layers:
    pos_BT = _positions(start, x_BTD.shape[0], x_BTD.shape[1])
    x_BTD, cache = _segment(pf, 'coda', c.coda_layers, c.coda_experts, cache, x_BTD, pos_BT)
  norm = RMSNorm(c.norm_gain, c.norm_eps, c.param_dtype)
  x_BTD = norm.apply({'params': pf.params.get('final_norm', {})}, x_BTD)
  logits = x_BTD @ head_matrix(c, pf.params, runtime=pf.runtime)
  return logits.astype(jnp.float32), cache


def run_back(pf: PassForward, cache, h_BTD, e_BTD, start, draft_loops: int):
  """Core passes [draft_loops, L), coda, norm and head on the states after pass
  `draft_loops`: the rest of the forward, (logits_BTV, cache)."""
  x, cache = run_passes(pf, cache, h_BTD, e_BTD, start, draft_loops, pf.loops)
  return run_readout(pf, cache, x, start)
