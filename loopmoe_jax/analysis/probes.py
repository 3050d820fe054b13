"""SMELT's mechanistic probes: Q/K/V similarity across visits, the attention sink, CE gain.

- Q/K/V similarity (SMELT, "what the second visit does"): for every shared core layer d and
  every pair of passes (l, l'), the cosine similarity of the query (key, value) vector of the
  same token and head at visit l and visit l', averaged over tokens and heads (keys and
  values over KV heads). The diagonal is 1. RoPE rotates both visits of a token by the same
  angle, so post-RoPE cosines equal pre-RoPE ones.
- Sink mass: the attention probability on the segment's first token (key 0), averaged over
  queries 1..T-1, heads and sequences; per visit for core layers, once for prelude/coda.
- CE gain of checkpoint A over reference B on a bucket of tokens: (CE_B - CE_A) / CE_B
  (relative, as SMELT's "CE Gain" percentages), with the absolute difference beside it.
  Length buckets: the data stream packs documents into fixed windows without per-sample
  lengths, so tokens are bucketed by their position in the window (context length
  available to the prediction). Domains: the data carries no domain labels, so a domain is a
  caller-named token array (e.g. the bytes of a file through the run's tokenizer).

The probes read values the attention sows only in a model built with `probe=True` and applied
with mutable=['intermediates'] (loopmoe_jax/attention.py); the core's scan stacks them per pass
(core.PER_PASS).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.data import corpus, pipeline
from loopmoe_jax.model import LoopedMoE, check_loops, variables
from loopmoe_jax.runtime import HERE, Runtime
from loopmoe_jax.train.run import as_loaded

log = logging.getLogger(__name__)

QKV = ('q', 'k', 'v')


@functools.lru_cache(maxsize=None)
def _probe_fn(cfg: ModelConfig, num_loops: int | None, runtime: Runtime):
  model = LoopedMoE(cfg, runtime=runtime, probe=True)

  def fn(params, tokens_BT):
    (logits, _), state = model.apply(variables(params), tokens_BT, num_loops=num_loops,
                                     mutable=['intermediates'])
    return logits, state['intermediates']
  return jax.jit(fn)


def _leaf(v):
  """A sown tuple -> one array (the scan stacks one entry per pass; an unrolled loop appends
  one entry per pass)."""
  return v[0] if len(v) == 1 else jnp.stack(v)


def _attention_values(seg_tree, layers: int) -> list[dict]:
  out = []
  for i in range(layers):
    att = seg_tree[f'layer_{i}']['attention']
    out.append({name: _leaf(att[name]) for name in (*QKV, 'sink')})
  return out


def probe_forward(cfg: ModelConfig, params, tokens_BT, num_loops: int | None = None,
                  *, runtime: Runtime):
  """(logits_BTV, probes) with probes {segment: [per layer {'q','k','v','sink'}]}: prelude/coda
  arrays q [B,T,H,K], k/v [B,T,G,K], sink [B,H]; core arrays with a leading pass axis L.
  `runtime`: the model's run settings (runtime.py; the loop's implementation, ...)."""
  n = check_loops(cfg, num_loops)
  logits, inter = _probe_fn(cfg, n, runtime)(params, jnp.asarray(tokens_BT, jnp.int32))
  probes = {}
  if cfg.prelude_layers:
    probes['prelude'] = _attention_values(inter['prelude'], cfg.prelude_layers)
  if cfg.core_layers:
    probes['core'] = _attention_values(inter['core']['body'], cfg.core_layers)
  if cfg.coda_layers:
    probes['coda'] = _attention_values(inter['coda'], cfg.coda_layers)
  return logits, probes


def pass_cosine(x_LBTHK) -> np.ndarray:
  """[L, L] mean over (b, t, h) of cos(x[l, b, t, h], x[l', b, t, h])."""
  x = np.asarray(x_LBTHK, np.float64)
  xn = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-30)
  count = np.prod(x.shape[1:-1])
  return np.einsum('lbthk,mbthk->lm', xn, xn) / count


def qkv_similarity(core_probes: Sequence[Mapping]) -> dict:
  """{'q'|'k'|'v': [D, L, L]} cosine similarity between visits per core layer."""
  return {name: np.stack([pass_cosine(p[name]) for p in core_probes]) for name in QKV}


def sink_mass(probes: Mapping) -> dict:
  """{segment: per-layer sink mass}; core [D, L] (per visit), prelude/coda [layers]. Each is
  the mean over sequences and heads of the mean over queries 1..T-1 of p(key 0)."""
  out = {}
  for seg, layers in probes.items():
    out[seg] = np.stack([np.asarray(p['sink'], np.float64).mean(axis=(-2, -1)) for p in layers])
  return out


def mechanistic_probes(cfg: ModelConfig, params, batches: Sequence[np.ndarray],
                       num_loops: int | None = None, *, runtime: Runtime) -> dict:
  """Q/K/V similarity between visits and sink mass over token batches [B, T] (equal shapes),
  averaged over the batches; JSON-ready lists. Core-less models get no 'qkv_cosine'."""
  sims, sinks = [], []
  for tokens in batches:
    _, probes = probe_forward(cfg, params, tokens, num_loops, runtime=runtime)
    if 'core' in probes:
      sims.append(qkv_similarity(probes['core']))
    sinks.append(sink_mass(probes))
  out = {'num_loops': check_loops(cfg, num_loops),
         'tokens': int(sum(np.asarray(b).size for b in batches)),
         'sink_mass': {s: np.mean([x[s] for x in sinks], axis=0).tolist() for s in sinks[0]}}
  if sims:
    out['qkv_cosine'] = {n: np.mean([s[n] for s in sims], axis=0).tolist() for n in QKV}
  else:
    out['qkv_cosine_skipped'] = 'the model has no looped core (model.core_layers=0)'
  return out


# ---- cross-entropy gain -------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _nll_fn(cfg: ModelConfig, num_loops: int | None):
  model = LoopedMoE(cfg)

  def fn(params, inputs_BT, targets_BT):
    logits, _ = model.apply(variables(params), inputs_BT, num_loops=num_loops)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0]
  return jax.jit(fn)


def token_nll(cfg: ModelConfig, params, inputs_BT, targets_BT,
              num_loops: int | None = None) -> np.ndarray:
  """Per-token next-token NLL [B, T] (nats)."""
  return np.asarray(_nll_fn(cfg, num_loops)(params, jnp.asarray(inputs_BT, jnp.int32),
                                             jnp.asarray(targets_BT, jnp.int32)))


def ce_gain(nll_a, nll_b) -> dict:
  """CE of A and of reference B over the same tokens, their difference and the relative gain
  (CE_B - CE_A) / CE_B."""
  a, b = float(np.mean(nll_a)), float(np.mean(nll_b))
  return {'ce_a': a, 'ce_b': b, 'diff': b - a, 'gain': (b - a) / b, 'tokens': int(np.size(nll_a))}


def ce_gain_by_position(nll_a_NT, nll_b_NT, num_buckets: int = 8) -> list[dict]:
  """CE gain per bucket of window positions [lo, hi) (equal-width buckets over 0..T)."""
  a, b = np.asarray(nll_a_NT), np.asarray(nll_b_NT)
  if a.shape != b.shape:
    raise ValueError(f'NLL arrays differ in shape: {a.shape} vs {b.shape}')
  t = a.shape[-1]
  edges = np.linspace(0, t, min(num_buckets, t) + 1).round().astype(int)
  return [{'positions': [int(lo), int(hi)], **ce_gain(a[..., lo:hi], b[..., lo:hi])}
          for lo, hi in zip(edges[:-1], edges[1:])]


def windows(tokens, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Non-overlapping (inputs, targets) windows [N, seq_len] of a 1-D token array."""
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  n = (tokens.size - 1) // seq_len
  if n < 1:
    raise ValueError(f'{tokens.size} tokens make no window of {seq_len} + 1 tokens')
  x = tokens[:n * seq_len + 1]
  return x[:-1].reshape(n, seq_len), x[1:].reshape(n, seq_len)


def ce_gain_by_domain(model_a, model_b, domains: Mapping[str, np.ndarray], seq_len: int,
                      num_loops_a: int | None = None, num_loops_b: int | None = None) -> dict:
  """{domain: ce_gain} of model A = (cfg, params) over reference B, on each named 1-D token
  array cut into windows of seq_len (the models must share the vocabulary)."""
  (cfg_a, pa), (cfg_b, pb) = model_a, model_b
  if cfg_a.vocab_size != cfg_b.vocab_size:
    raise ValueError(f'vocabularies differ: {cfg_a.vocab_size} vs {cfg_b.vocab_size}')
  out = {}
  for name, toks in domains.items():
    x, y = windows(toks, seq_len)
    out[name] = ce_gain(token_nll(cfg_a, pa, x, y, num_loops_a),
                        token_nll(cfg_b, pb, x, y, num_loops_b))
  return out


# ---- from run directories -------------------------------------------------------------------

def validation_inputs(config: dict, vocab: int, tokens: int):
  """Validation (inputs, targets) [N, T] of a run, at least `tokens` tokens when it has them."""
  dc = pipeline.DataConfig.from_dict(config['data'])
  need = max(1, -(-tokens // (dc.batch_size * dc.seq_len)))
  batches = pipeline.validation_batches(dataclasses.replace(dc, val_batches=need), vocab)
  if not batches:
    raise ValueError('the run has no validation data (data.val_path is empty)')
  have = sum(b['inputs'].size for b in batches)
  if have < tokens:
    log.warning(f'the validation split holds {have} tokens, fewer than the {tokens} asked')
  return [b['inputs'] for b in batches], [b['targets'] for b in batches]


def probe_workdir(workdir, tokens: int = 8192, step: int | None = None,
                  num_loops: int | None = None) -> dict:
  """mechanistic_probes of a checkpoint over about `tokens` validation tokens."""
  run = as_loaded(workdir, step)
  inputs, _ = validation_inputs(run.config, run.model_cfg.vocab_size, tokens)
  return {'step': run.step, **mechanistic_probes(run.model_cfg, run.variables, inputs, num_loops,
                                                 runtime=run.runtime)}


def embedded_domains(config: dict, tokens_per_domain: int = 32768) -> dict[str, np.ndarray]:
  """Domains of the embedded corpus's validation documents, by document name: 'code' (the
  standard library's .py sources) and 'docs' (pydoc help topics), byte tokens, each capped
  at tokens_per_domain. Other sources carry no domain labels: pass named token arrays."""
  data = config['data']
  if data['source'] != 'embedded' or data['tokenizer'] != 'byte':
    raise ValueError(f"data.source={data['source']!r}: domain labels exist only for the "
                     'embedded corpus; pass named token arrays (domains=...) instead')
  docs = corpus.split(data['val_fraction'])['validation']
  groups = {'code': [t for n, t in docs if n.endswith('.py')],
            'docs': [t for n, t in docs if n.startswith('pydoc_data/')]}
  out = {}
  for name, texts in groups.items():
    b = '\n'.join(texts).encode('utf-8', errors='replace')[:tokens_per_domain + 1]
    if len(b) > data['seq_len']:
      out[name] = np.frombuffer(b, np.uint8).astype(np.int32)
  return out


def ce_gain_workdirs(dir_a: str, dir_b: str, tokens: int = 8192, num_buckets: int = 8,
                     domains: Mapping[str, np.ndarray] | None = None) -> dict:
  """CE gain of run A's checkpoint over run B's: by window-position bucket on A's validation
  windows, and by domain (`domains`, else the embedded corpus's code/docs split)."""
  a, b = as_loaded(dir_a), as_loaded(dir_b)
  (cfg_a, pa, sa, config), (cfg_b, pb, sb) = ((a.model_cfg, a.variables, a.step, a.config),
                                              (b.model_cfg, b.variables, b.step))
  if cfg_a.vocab_size != cfg_b.vocab_size:
    raise ValueError(f'{dir_a!r} and {dir_b!r} have different vocabularies '
                     f'({cfg_a.vocab_size} vs {cfg_b.vocab_size})')
  inputs, targets = validation_inputs(config, cfg_a.vocab_size, tokens)
  nll_a = np.concatenate([token_nll(cfg_a, pa, x, y) for x, y in zip(inputs, targets)])
  nll_b = np.concatenate([token_nll(cfg_b, pb, x, y) for x, y in zip(inputs, targets)])
  out = {'step_a': sa, 'step_b': sb, 'gain': '(CE_B - CE_A) / CE_B', 'overall':
         ce_gain(nll_a, nll_b), 'by_position': ce_gain_by_position(nll_a, nll_b, num_buckets)}
  if domains is None:
    domains = embedded_domains(config, tokens)
    out['domains_from'] = 'embedded corpus validation documents: .py sources vs pydoc topics'
  out['by_domain'] = ce_gain_by_domain((cfg_a, pa), (cfg_b, pb), domains,
                                       config['data']['seq_len'])
  return out
