"""Batched generation (batched.py), sampling settings (sampling.py) and the prompts file of
scripts/generate.py (text_generation.py): every row of a batch of mixed-length prompts is the
prompt's generation alone, greedy and sampled, with stop tokens; top-k / top-p keep the sets
they name."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax.batched import generate_batch
from loopmoe_jax.decode import decode_step, generate, init_cache, mean_passes
from loopmoe_jax.model import LoopedMoE, for_init
from loopmoe_jax.sampling import Sampling
from loopmoe_jax.text_generation import read_prompts

from helpers import make_cfg, rt

RT = rt()
LENGTHS = (1, 3, 9, 5, 2, 7, 4, 11)  # pads to 8 and 16: two programs alone, one batched


@pytest.fixture(scope='module')
def tiny():
  cfg = make_cfg(num_loops=2, injection='add')
  params = nn.unbox(for_init(LoopedMoE(cfg)).init(jax.random.key(0),
                                                 jnp.zeros((1, 4), jnp.int32)))['params']
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in LENGTHS]
  return cfg, params, prompts


@pytest.mark.slow
@pytest.mark.parametrize('sampling', [Sampling(), Sampling(0.9, top_k=10, top_p=0.9)], ids=str)
def test_rows_are_their_prompts_alone(tiny, sampling):
  cfg, params, prompts = tiny
  stops = (3,) if not sampling.greedy else ()
  together = generate_batch(cfg, params, prompts, 10, jax.random.key(0), sampling, stops,
                            batch_size=8, runtime=RT)
  for i, prompt in enumerate(prompts):
    alone = generate_batch(cfg, params, [prompt], 10, jax.random.key(0), sampling, stops,
                           batch_size=1, runtime=RT, prompt_ids=[i])
    assert together[i] == alone[0], f'prompt {i} of {len(prompt)} tokens'


@pytest.mark.slow
def test_greedy_rows_are_plain_greedy(tiny):
  """Mixed lengths in one batch (3 rows pad to 16) against decode.generate of each prompt."""
  cfg, params, prompts = tiny
  picked = [prompts[2], prompts[1], prompts[7]]
  rows = generate_batch(cfg, params, picked, 10, jax.random.key(0), batch_size=3, runtime=RT)
  for prompt, row in zip(picked, rows):
    plain = generate(cfg, params, jnp.asarray([prompt]), 10, jax.random.key(0), runtime=RT)
    assert row.tokens == np.asarray(plain[0, len(prompt):]).tolist() and not row.stopped


def test_stop_token_ends_a_row():
  """A smaller model (one core layer, a dense coda: a quick compile), prompts of 9, 3, 11."""
  cfg = make_cfg(num_loops=2, core_layers=1, prelude_layers=0, coda_experts=0)
  params = nn.unbox(for_init(LoopedMoE(cfg)).init(jax.random.key(0),
                                                 jnp.zeros((1, 4), jnp.int32)))['params']
  rng = np.random.default_rng(1)
  picked = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (9, 3, 11)]
  free = generate_batch(cfg, params, picked, 10, jax.random.key(0), batch_size=3, runtime=RT)
  stop = free[0].tokens[3]
  rows = generate_batch(cfg, params, picked, 10, jax.random.key(0), stop_tokens=(stop,),
                        batch_size=3, runtime=RT)
  for f, r in zip(free, rows):
    cut = f.tokens.index(stop) + 1 if stop in f.tokens else len(f.tokens)
    assert r.tokens == f.tokens[:cut] and r.stopped == (stop in f.tokens)


@pytest.mark.parametrize('kw', [dict(kv_cache='last_pass'), dict(exit='gate', exit_threshold=0.5),
                                dict(capacity_factor=1.0)], ids=lambda kw: next(iter(kw)))
def test_rows_alone_under_shared_cache_exit_and_capacity(kw):
  """Per-row positions under a shared core cache and under a per-token exit (a row's skipped
  passes filled at its own positions); under capacity each row routes as its own batch."""
  cfg = make_cfg(num_loops=3, core_layers=1, prelude_layers=0, coda_experts=0, **kw)
  params = nn.unbox(for_init(LoopedMoE(cfg)).init(jax.random.key(0),
                                                 jnp.zeros((1, 4), jnp.int32)))['params']
  rng = np.random.default_rng(2)
  picked = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (2, 7, 5)]
  if cfg.exit == 'gate':  # a gate that sends tokens out after 1, 2 or 3 passes
    params = {**params, 'exit_gate_w': 2 * jax.random.normal(jax.random.key(5), (cfg.d_model,))}
    _, cache = decode_step(cfg, params, init_cache(cfg, 1, 8), jnp.asarray([picked[1]]))
    assert 1.2 < float(mean_passes(cache)) < 2.8
  rows = generate_batch(cfg, params, picked, 8, jax.random.key(0), batch_size=3, runtime=RT)
  for i, prompt in enumerate(picked):
    alone = generate_batch(cfg, params, [prompt], 8, jax.random.key(0), batch_size=1,
                           runtime=RT, prompt_ids=[i])
    assert rows[i] == alone[0], f'prompt {i} of {len(prompt)} tokens'


def test_top_k_and_top_p_keep_their_sets():
  logits = jnp.log(jnp.asarray([0.4, 0.3, 0.15, 0.1, 0.05]))
  assert np.count_nonzero(Sampling(1.0, top_k=2).probs(logits)) == 2
  p = np.asarray(Sampling(1.0, top_p=0.7).probs(logits))  # 0.4 + 0.3 reaches 0.7
  np.testing.assert_allclose(p, [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0], rtol=1e-5)
  p = np.asarray(Sampling(1.0, top_p=0.71).probs(logits))
  assert np.count_nonzero(p) == 3
  assert np.count_nonzero(Sampling(1.0, top_p=0.1).probs(logits)) == 1  # the best stays
  np.testing.assert_array_equal(Sampling().probs(logits), [1, 0, 0, 0, 0])


@pytest.mark.parametrize('kw, match', [(dict(temperature=-1.0), 'temperature=-1.0'),
                                       (dict(top_k=-1), 'top_k=-1'),
                                       (dict(top_p=0.0), 'top_p=0.0')])
def test_bad_sampling_settings(kw, match):
  with pytest.raises(ValueError, match=match):
    Sampling(**kw)


def test_bad_batches(tiny):
  cfg, params, _ = tiny
  with pytest.raises(ValueError, match='max_new=0'):
    generate_batch(cfg, params, [[1]], 0, jax.random.key(0))
  with pytest.raises(ValueError, match='at least one token'):
    generate_batch(cfg, params, [[1], []], 4, jax.random.key(0))
  with pytest.raises(ValueError, match='batch_size=0'):
    generate_batch(cfg, params, [[1]], 4, jax.random.key(0), batch_size=0)


def test_read_prompts(tmp_path):
  path = tmp_path / 'p.jsonl'
  path.write_text('{"prompt": "def "}\n\n"class A"\n')
  assert read_prompts(str(path)) == ['def ', 'class A']
  path.write_text('{"prompt": "def "}\n{"text": 1}\n')
  with pytest.raises(ValueError, match=r'p.jsonl:2: want a non-empty string'):
    read_prompts(str(path))
  path.write_text('{oops\n')
  with pytest.raises(ValueError, match=r'p.jsonl:1: not JSON'):
    read_prompts(str(path))
