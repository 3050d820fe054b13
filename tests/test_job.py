"""The Job owns its programs: made once per key, never shared between Jobs, freed with it."""
import gc

import jax
import numpy as np
import pytest

from loopmoe_jax.experiment import build
from loopmoe_jax.job import Job
from loopmoe_jax.train import step as steps

from helpers import tiny


def _job(**train):
  return Job.build(build(tiny(**train)), jax.devices()[:1])


def _batch(job, seed=0):
  rng = np.random.default_rng(seed)
  d = job.exp.data
  t = rng.integers(0, job.exp.model.vocab_size, (d.batch_size, d.seq_len + 1), np.int32)
  return steps.put_batch({'inputs': t[:, :-1], 'targets': t[:, 1:]}, job.batch_sh)


def _live():
  gc.collect()
  return len(jax.devices()[0].client.live_executables())


def test_a_job_makes_each_program_once_and_another_job_shares_none():
  """One program per key within a Job; two Jobs of different learning rates each run their
  own program: from the same state and batch, the updates differ by the ratio of the rates
  (AdamW's first step moves each weight by about lr), and each Job's program gives what a
  fresh Job of its settings gives."""
  a, b = _job(lr=1e-3, warmup=0), _job(lr=2e-3, warmup=0)
  assert a.train_step() is a.train_step() and a.train_step(1) is not a.train_step()
  assert a.eval_step(1) is a.eval_step(1) and a.eval_step(1) is not a.eval_step(2)
  assert a.train_step() is not b.train_step() and a.train_programs == 2
  moved = {}
  for name, job in (('a', a), ('b', b)):
    state = job.create_state()
    before = jax.device_get(state['params'])
    new, _ = job.train_step()(state, _batch(job))
    moved[name] = [np.max(np.abs(x - y)) for x, y in
                   zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(new['params'])))]
  np.testing.assert_allclose(np.array(moved['b']) / np.array(moved['a']), 2.0, rtol=0.05)


def test_dropping_a_job_frees_its_programs():
  """What a Job compiled (init, train, eval, routing steps) is held by it alone: after it is
  dropped the process holds as many executables as before it was built. A first Job warms
  jax's own caches of eager operations; the second is measured."""
  def use():
    job = _job(steps=2)
    state = job.create_state()
    batch = _batch(job)
    state, metrics = job.train_step()(state, batch)
    state, _ = job.train_step(1)(state, batch)
    total, _ = job.eval_step()(state['params'], batch)
    job.routing_step()(state['params'], batch)
    assert job.all_finite(state['params'])
    jax.block_until_ready((metrics, total))
    return len(job.programs)

  use()
  before = _live()
  made = use()
  assert made == 5
  assert _live() == before


@pytest.mark.parametrize('field, value, key', [('batch_size', 12, r'data\.batch_size=12'),
                                               ('attention', 'cudnn', r'run\.attention_impl')])
def test_a_job_refuses_what_its_mesh_or_platform_cannot_run(field, value, key):
  """Building a Job checks the batch against the mesh and the run settings against the
  platform (attention_impls.check), for every entry point, before anything is traced."""
  cfg = tiny()
  if field == 'batch_size':
    cfg.data.batch_size = value
  else:
    cfg.run.attention_impl = value
  with pytest.raises(ValueError, match=key):
    Job.build(build(cfg))
