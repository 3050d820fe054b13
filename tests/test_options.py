"""Loop options that must not change the function: remat policies, compute dtype.

The model dispatches with 'xla' (ragged_dot; half the trace time of the CPU default 'tiled',
whose custom VJP one remat case checks too)."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax import core
from loopmoe_jax.config import REMAT_POLICIES, ModelConfig
from loopmoe_jax.hlo import dot_flops
from loopmoe_jax.model import LoopedMoE
from loopmoe_jax.objective import loss_fn
from loopmoe_jax.runtime import Runtime

CFG = ModelConfig(vocab_size=64, d_model=32, num_heads=2, expert_width=32, core_layers=2,
                  num_loops=3, prelude_layers=1, coda_layers=1, tie_attention=False)


def _model(cfg=CFG, **run):
  """The model of `cfg` dispatching with 'xla', the run settings `run` replaced."""
  return LoopedMoE(cfg, runtime=Runtime.of(**{'dispatch': 'xla', **run}))


def _batch():
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)
  return {'inputs': toks, 'targets': jnp.roll(toks, -1, 1), 'mask': jnp.ones((2, 12))}


def _init(cfg):
  return nn.unbox(jax.jit(_model(cfg).init)(jax.random.key(0), _batch()['inputs'])['params'])


def _loss(cfg, params):
  return jax.jit(lambda p, b: loss_fn(p, _model(cfg), b))(params, _batch())


def _grads(cfg, params):
  return jax.jit(jax.grad(lambda p, b: loss_fn(p, _model(cfg), b)[0]))(params, _batch())


def _loss_and_grads(params, **run):
  """(reported LM loss, gradients) from one compiled value_and_grad, under run settings `run`."""
  fn = jax.value_and_grad(lambda p, b: loss_fn(p, _model(**run), b), has_aux=True)
  (_, metrics), grads = jax.jit(fn)(params, _batch())
  return float(metrics['loss']), grads


_PLAIN = {}


def plain(dispatch):
  """Params, loss and gradients with remat none, 'xla' attention, the loss in one piece."""
  if dispatch not in _PLAIN:
    params = _init(CFG)
    _PLAIN[dispatch] = (params, *_loss_and_grads(params, attention_impl='xla',
                                                  dispatch=dispatch))
  return _PLAIN[dispatch]


@pytest.mark.parametrize('policy,dispatch', [(p, 'xla') for p in REMAT_POLICIES if p != 'none']
                         + [('full', 'tiled')])
def test_remat_gives_the_same_loss_and_gradients(policy, dispatch):
  """Each policy (prelude, core and coda rematerialised, the head and loss too), here with
  chunked attention over blocks that do not divide the length and a chunked loss, gives
  today's loss and gradients."""
  params, loss, ref = plain(dispatch)
  got_loss, got = _loss_and_grads(params, remat=policy, attention_impl='chunked',
                                  attention_block=5, loss_chunk=5, dispatch=dispatch)
  assert got_loss == pytest.approx(loss, rel=1e-6)
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bfloat16_compute_keeps_float32_params_and_tracks_float32():
  cfg16 = CFG.replace(dtype='bfloat16')
  params = _init(cfg16)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  l32, _ = _loss(CFG, params)
  l16, m16 = _loss(cfg16, params)
  assert m16['loss'].dtype == jnp.float32
  assert abs(float(l16) - float(l32)) < 0.05 * float(l32)
  g = _grads(cfg16, params)
  assert all(x.dtype == jnp.float32 and np.isfinite(x).all() for x in jax.tree.leaves(g))


def _step_dot_flops(**run):
  model, batch = _model(**run), _batch()
  step = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, model, batch)[0]))
  return dot_flops(step.lower(_init(CFG)).compiler_ir('hlo').as_hlo_text())


def test_token_chunks_add_no_forward_where_the_policy_keeps_the_expert_output(monkeypatch):
  """run.expert_block_rows on one device (48 routed rows, 4 a chunk: 12 chunks, each
  recomputed in its own backward): under pass_input and attention, which keep 'expert_out',
  the pass's recompute runs no MoE forward, so the step's matmul FLOPs (with loop trip counts)
  equal the unchunked step's; so under full, whose per-layer recompute needs no layer output;
  without 'expert_out' in the policy attention's chunks add one expert forward."""
  flops = {(p, r): _step_dot_flops(remat=p, attention_impl='chunked', attention_block=5,
                                   loss_chunk=5, expert_block_rows=r)
           for p in ('pass_input', 'attention', 'full') for r in (0, 4)}
  assert flops['pass_input', 4] == flops['pass_input', 0], flops
  assert flops['attention', 4] == flops['attention', 0], flops
  assert flops['full', 4] == flops['full', 0], flops
  # the same policy without 'expert_out': the extra forward is back
  monkeypatch.setitem(core.REMAT, 'attention', jax.checkpoint_policies.save_only_these_names(
      'exchange', 'attn_qkv', 'attention'))
  assert _step_dot_flops(remat='attention', attention_impl='chunked', attention_block=5,
                         loss_chunk=5, expert_block_rows=4) > flops['attention', 4]


@pytest.mark.parametrize('policy,names', [
    ('full', set()), ('pass_input', set()),  # one device: no exchange to keep
    ('full_keep_exchange', set()),
    ('attention', {'attn_qkv', 'attention'}),
    # 'expert_out' is named too, but no backward reads the expert output: nothing to keep
    ('named', {'attn_qkv', 'attention', 'router'})])
def test_each_policy_saves_exactly_its_named_checkpoints(policy, names, capsys):
  """What the backward keeps under each policy (jax.ad_checkpoint.print_saved_residuals, with
  chunked attention and the chunked loss): exactly the checkpoint names the policy lists;
  with 'attention' the attention output and its log-sum-exp (so chunked attention's forward
  is not recomputed)."""
  model = _model(remat=policy, attention_impl='chunked', attention_block=5, loss_chunk=5)
  batch = _batch()
  jax.ad_checkpoint.print_saved_residuals(lambda p: loss_fn(p, model, batch)[0], _init(CFG))
  saved = capsys.readouterr().out
  assert set(re.findall(r"named '(\w+)'", saved)) == names, saved
  if 'attention' in names:  # the output [B, T, H, K] and the log-sum-exp [B, G, Q, T]
    shapes = set(re.findall(r"(\S+) named 'attention'", saved))
    assert len(shapes) == 2, shapes


def test_exchange_rows_auto_and_run_errors_name_the_key():
  """run.exchange_rows 'auto' is token rows under every remat policy but none (whose
  backward would keep the worst-case expansion's outputs); a given value stays; bad values
  and streams below 1 are refused naming the key."""
  from loopmoe_jax.config import RunConfig
  assert RunConfig(remat='none').exchange_unit == 'assignment'
  assert {RunConfig(remat=p).exchange_unit for p in ('full', 'attention', 'pass_input')} == {'token'}
  assert RunConfig(remat='none', exchange_rows='token').exchange_unit == 'token'
  with pytest.raises(ValueError, match=r"run.exchange_rows='rows': must be one of"):
    RunConfig(exchange_rows='rows')
  with pytest.raises(ValueError, match=r'run.exchange_streams=0: must be >= 1'):
    RunConfig(exchange_streams=0)
