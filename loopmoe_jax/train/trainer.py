"""A run from its config and work directory: the Job, the restored or initial state, the
loop (train/loop.py), the summary and a sample.

    summary = train(config_dict, workdir)

Resumes from the newest readable checkpoint in `workdir` (batches and losses continue exactly
as an uninterrupted run), or starts from `train.init_from` (a continuation with a longer
schedule), or from scratch. From the first step's dispatch SIGTERM/SIGINT save a checkpoint
and return, on every process at the same step whichever process caught them
(train/preempt.py), the summary's `stopped_by` naming the signal (scripts/train.py exits with
its status, 130 or 143); before it a script exits at once (cli.exit_on_interrupt). The clock
saves too, every train.save_every_minutes. The summary's final_window_loss averages the last
train.final_window steps, fewer for a run too short for them after train.warmup (a note says
so; metrics.final_window). With
train.loops_sampler each step runs the core's pass count drawn for it from (seed, step), in
the program compiled for that count (train/depth.py; one per count drawn, each printed as it
is made, their number in the summary as 'compiled_programs'). A non-finite loss or gradient
norm, or non-finite parameters about to be saved, stop the run with loop.TrainingDiverged:
no checkpoint of them is written. A save that cannot be written (a full disk)
stops the run with checkpoint.CheckpointSaveError, one line. A second trainer on the same
workdir is refused (lock.WorkdirLocked, naming the holder).
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from loopmoe_jax import accounting, attention_impls, storage
from loopmoe_jax.data import pipeline
from loopmoe_jax.decode import generate
from loopmoe_jax.dispatch import resolve_backend
from loopmoe_jax.experiment import RUN_SETTINGS, build, config_diff
from loopmoe_jax.expert_parallel import exchange_kind
from loopmoe_jax.job import Job
from loopmoe_jax.train import checkpoint, compile_cache, depth, preempt, preflight
from loopmoe_jax.train.goodput import Goodput
from loopmoe_jax.train.lock import WorkdirLock
from loopmoe_jax.train.loop import Loop
from loopmoe_jax.train.run import METRICS, ROUTING, SUMMARY, RunDir


def train(cfg, workdir: str, force: bool = False, start_over: bool = False) -> dict:
  """Trains (or resumes) the run in `workdir`; `force` skips the pre-flight memory check
  (train/preflight.py); `start_over` starts a run none of whose checkpoints reads back from
  step 0, its steps and logs moved to unreadable_checkpoints/ (without it that is an error).
  Installs the quiet Orbax error hooks (checkpoint.quiet_orbax_errors) for the process."""
  checkpoint.quiet_orbax_errors()
  exp = build(cfg)
  check_workdir(workdir)
  pipeline.check_data(exp.data, exp.model.vocab_size)  # before any model is built
  with WorkdirLock(workdir, owner=jax.process_index() == 0), preempt.StopSignals() as caught:
    return _train(cfg, exp, workdir, caught, force, start_over)


def check_workdir(workdir: str):
  """A ValueError naming --workdir and a fix when it cannot hold a run: empty, a file, or a
  directory (or the nearest existing parent) this user cannot write."""
  if not workdir or not workdir.strip():
    raise ValueError('--workdir is empty: give the run directory, e.g. --workdir=/tmp/run')
  if storage.is_url(workdir):  # object storage: the bucket must be reachable
    storage.check_reachable(workdir, '--workdir')
    return
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f'--workdir={workdir} is a file, not a directory: choose another path')
  existing = os.path.abspath(workdir)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f'--workdir={workdir}: {existing} is not writable by this user: choose '
                     'another path or fix its permissions')


def _train(cfg, exp, workdir: str, caught: preempt.StopSignals, force: bool = False,
           start_over: bool = False) -> dict:
  job = Job.build(exp)
  if not force:  # before anything is compiled
    preflight.check_memory(exp, job.mesh, job.abstract_state)
  clock = Goodput()  # wall time from here: restore, compiles, data, saves, evaluation, steps
  cache_dir = compile_cache.use(exp.train.compile_cache, workdir)
  tc = exp.train
  mngr = checkpoint.manager(RunDir(workdir).checkpoints, tc.keep, tc.async_save,
                            keep_every=tc.keep_every, keep_steps=tc.kept_steps)
  with clock.spent('restore'):
    state, data_state, start = _initial_state(mngr, job, workdir, start_over)
  summary_path = RunDir(workdir).file(SUMMARY)
  if start >= tc.steps and storage.exists(summary_path):
    print(f'{workdir} already finished at step {start}', flush=True)
    return json.loads(storage.read_text(summary_path))
  loop = Loop(job, workdir, mngr, clock, cache_dir, start=start, state=state,
              data_state=data_state or {}, config_json=cfg.to_json())
  if jax.process_index() == 0:
    print(_banner(job, start), flush=True)
  final = loop.run(caught)
  summary = loop.summary(final)
  if jax.process_index() == 0:
    storage.write_text(summary_path, json.dumps(summary, indent=1))
    print('summary: ' + json.dumps({k: summary[k] for k in
                                    ('steps', 'final_window_loss', 'final_window',
                                     'val_loss', 'val_step',
                                     'tokens_per_s', 'compiled_programs')}))
  if tc.sample_tokens and not loop.decision.stop:
    _sample(job, loop.state)
  return summary


def _banner(job, start: int) -> str:
  """The run's first line: the model, data, steps, devices and what the run settings resolve
  to on this platform."""
  mc, tc, dc, run = job.exp.model, job.exp.train, job.exp.data, job.exp.run
  acct = accounting.count(mc, dc.seq_len)
  attention = attention_impls.resolve(run.attention_impl, mc.dtype, None, mc.resolved_head_dim)
  return (f"model: {acct['params_total']:,} params ({acct['params_active']:,} active/token), "
          f"{mc.executed_layers} executed layers; data: {dc.source}, batch {dc.batch_size} x "
          f"{dc.seq_len}; steps {start} -> {tc.steps} on {jax.device_count()} device(s)"
          f"{_mesh_text(job.mesh)}; dispatch {run.dispatch} -> "
          f"{resolve_backend(run.dispatch, runtime=job.runtime)}"
          f"{_exchange_text(job.runtime, job.mesh)}; attention {run.attention_impl} -> {attention}"
          f"{depth.describe(tc, mc.num_loops)}")


def _sample(job, state):
  """Prints a text sample of the trained model (process 0; every process joins the gather of
  a multi-process run's parameters)."""
  params, bias = state['params'], state.get('router_bias')
  if jax.process_count() > 1:
    params, bias = multihost_utils.process_allgather((params, bias), tiled=True)
  if jax.process_index() == 0:
    _print_sample(job.exp.model, params, job.exp.data, job.exp.train, bias, job.runtime)


# data fields that leave the training stream as it was: they may change on resume
DATA_FREE_ON_RESUME = tuple(f'data.{k}' for k in ('val_path', 'val_batches', 'num_threads',
                                                  'prefetch'))


def _check_same_run(stored: dict, exp, where: str, mismatch: str | None = ''):
  """A ValueError listing every difference when the checkpoint at `where` was written with
  another model or data stream (its shapes or batches would not continue this run), or when
  its train state does not fit this run's (`mismatch`, checkpoint.StateMismatch's message;
  e.g. another optimizer state after train.clip changed from or to 0; the changed train
  settings are listed with it); other changed train settings (a lower lr, more steps) are
  allowed and printed."""
  diffs, notes = [], []
  for key, old, new in config_diff(stored, exp):
    line = f'{key}: {old!r} in the checkpoint, {new!r} now'
    free = (key.startswith(('train.', 'mesh.')) or key in DATA_FREE_ON_RESUME or
            key in RUN_SETTINGS)
    (notes if free else diffs).append(line)
  if mismatch:
    diffs += [mismatch] + notes
  if diffs:
    raise ValueError(f'{where} was written by a different run:\n  ' + '\n  '.join(diffs) +
                     '\nUse a new workdir (or train.init_from for a continuation with the '
                     'same model and data).')
  if notes and jax.process_index() == 0:
    print('resuming with changed settings: ' + '; '.join(notes), flush=True)


def _initial_state(mngr, job, workdir, start_over=False):
  exp, target = job.exp, job.abstract_state
  tc = exp.train
  stored = checkpoint.stored_config(mngr)
  where = f'checkpoint step {stored[0]} in {mngr.directory}' if stored else ''
  if stored is not None:
    _check_same_run(stored[1], exp, where)
  skipped = {}  # {step: why} of the steps that do not read back
  try:
    restored = checkpoint.restore_latest(mngr, target, skipped=skipped)
  except checkpoint.StateMismatch as e:
    if stored:  # name the changed settings with it
      _check_same_run(stored[1], exp, where, str(e))
    raise
  if restored is None and skipped and not start_over:  # never start over on top of a run
    # whose steps all fail, unless asked to
    why = '; '.join(f'step {s}: {reason}' for s, reason in skipped.items())
    raise RuntimeError(f'every checkpoint step in {mngr.directory} is unreadable ({why}); '
                       'nothing was changed. Restore them from a copy, or start this run over '
                       'with --start_over (the steps and logs are moved aside, not deleted)')
  if skipped:  # newer steps that do not read (with --start_over and nothing readable: the
    # old run's logs too) are set aside
    logs = (METRICS, ROUTING, SUMMARY) if restored is None else ()
    for path in checkpoint.set_aside(mngr, skipped, workdir, logs):
      print(f'moved the unreadable checkpoint to {path}', flush=True)
    if restored is None:
      print(f'starting {workdir} over (--start_over): its old logs are in '
            f'{storage.join(workdir, "unreadable_checkpoints")}', flush=True)
  if restored is None and tc.init_from:
    src = checkpoint.manager(storage.join(tc.init_from, 'checkpoints'), read_only=True,
                             async_save=False)
    src_config = checkpoint.stored_config(src)
    where = f'train.init_from={tc.init_from!r}'
    if src_config is not None:
      _check_same_run(src_config[1], exp, where)
    try:
      restored = checkpoint.restore_latest(src, target, None if tc.init_step < 0 else tc.init_step)
    except checkpoint.StateMismatch as e:
      if src_config:
        _check_same_run(src_config[1], exp, where, str(e))
      raise
    if restored is None:
      raise FileNotFoundError(f'train.init_from={tc.init_from!r}: no readable checkpoint')
  if restored is not None:
    s, state, data_state, _ = restored
    print(f'resuming from step {s}', flush=True)
    return state, data_state, s
  return job.create_state(), None, 0


def _mesh_text(mesh) -> str:
  axes = [f'{a}={n}' for a, n in mesh.shape.items() if n > 1]
  return f" (mesh {' x '.join(axes)})" if axes else ''


def _exchange_text(runtime, mesh) -> str:
  if mesh.shape['expert'] == 1:
    return ''
  kind = runtime.run.expert_exchange
  return f', expert exchange {kind} -> {exchange_kind(kind, runtime=runtime)}'


def _print_sample(mc, params, dc, tc, router_bias, runtime):
  tok = pipeline.data_tokenizer(dc)
  if tok is None:
    print(f'no sample: the tokenizer {pipeline.tokenizer_spec(dc)!r} of the training data '
          'cannot be loaded', flush=True)
    return
  prompt = tok.encode(tc.sample_prompt)[None, :]
  if prompt.size == 0:
    return
  out = generate(mc, params, prompt, tc.sample_tokens, jax.random.key(tc.seed),
                 temperature=0.8, router_bias=router_bias, runtime=runtime)
  print('sample:\n' + tok.decode(np.asarray(out[0])), flush=True)
