"""The training loop: owns the data iterator, the Orbax manager and the metric writers.

    summary = train(config_dict, workdir)

Resumes from the newest readable checkpoint in `workdir` (batches and losses continue exactly
as an uninterrupted run), or starts from `train.init_from` (a continuation with a longer
schedule), or from scratch. SIGTERM/SIGINT save a checkpoint and return cleanly, on every
process at the same step whichever process caught them (train/preempt.py); so does the clock,
every train.save_every_minutes. With
train.loops_sampler each step runs the core's pass count drawn for it from (seed, step), in
the program compiled for that count (train/depth.py; one per count drawn, each printed as it
is made, their number in the summary as 'compiled_programs'). A non-finite loss or gradient
norm, or non-finite parameters about to be saved, stop the run with TrainingDiverged: no
checkpoint of them is written. A save that cannot be written (a full disk)
stops the run with checkpoint.CheckpointSaveError, one line. A second trainer on the same
workdir is refused (lock.WorkdirLocked, naming the holder).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time

import jax
import numpy as np

from loopmoe_jax import accounting, attention_impls, sharding, storage, targets
from loopmoe_jax.dispatch import resolve_backend
from loopmoe_jax.expert_parallel import exchange_kind
from loopmoe_jax.data import pipeline
from loopmoe_jax.experiment import RUN_SETTINGS, build, config_diff
from loopmoe_jax.model import LoopedMoE
from loopmoe_jax.train import checkpoint, compile_cache, depth, preempt, preflight, step as steps
from loopmoe_jax.train.goodput import Goodput
from loopmoe_jax.train.lock import WorkdirLock
from loopmoe_jax.train import metrics as metrics_lib
from loopmoe_jax.train.metrics import Writer
from loopmoe_jax.train.run import METRICS, ROUTING, SUMMARY, RunDir
from loopmoe_jax.train.optimizer import make_optimizer
from loopmoe_jax.train.profile import StepProfiler



class TrainingDiverged(RuntimeError):
  pass


def peak_flops(cfg_peak: float) -> float:
  """Peak FLOP/s of one device: train.peak_flops, else the chip's row in targets.CHIPS."""
  if cfg_peak:
    return cfg_peak
  return targets.peak_flops(jax.devices()[0].device_kind, targets.devices_per_chip(jax.devices()))


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
  mc, tc, dc, run = exp.model, exp.train, exp.data, exp.run
  model = LoopedMoE(mc, runtime=exp.runtime())
  tx, schedule = make_optimizer(tc)
  n_dev, proc, n_proc = jax.device_count(), jax.process_index(), jax.process_count()
  mesh = sharding.make_mesh(exp.mesh)
  sharding.check_batch(dc.batch_size, tc.microbatches, mesh)
  state_sh, batch_sh = steps.shardings(mesh, model, tx, dc.seq_len, exp.mesh.zero_data)
  target = steps.abstract_state(model, tx, dc.seq_len, state_sh)
  if not force:  # before anything is compiled
    preflight.check_memory(exp, mesh, target)
  run_dir = RunDir(workdir)
  clock = Goodput()  # wall time from here: restore, compiles, data, saves, evaluation, steps
  cache_dir = compile_cache.use(tc.compile_cache, workdir)
  mngr = checkpoint.manager(run_dir.checkpoints, tc.keep, tc.async_save,
                            keep_every=tc.keep_every, keep_steps=tc.kept_steps)
  with clock.spent('restore'):
    state, data_state, start = _initial_state(mngr, target, model, tx, exp, state_sh, workdir,
                                              start_over)
  summary_path = run_dir.file(SUMMARY)
  if start >= tc.steps and storage.exists(summary_path):
    print(f'{workdir} already finished at step {start}', flush=True)
    return json.loads(storage.read_text(summary_path))
  data_state = data_state or {}
  # The last W per-step losses travel with the checkpoint so the summary is exact on resume.
  losses = list(data_state.get('recent_losses', []))

  rows = sharding.process_rows(batch_sh, dc.batch_size)  # what this process's devices hold
  it = pipeline.train_iterator(dc, mc.vocab_size, max(tc.steps, tc.total_steps) + 1, rows,
                               data_state.get('iterator'))
  val = pipeline.validation_batches(dc, mc.vocab_size, rows)
  programs = depth.TrainSteps(model, tx, schedule, tc, state_sh, batch_sh)
  step_flops = {}  # pass count -> train FLOPs per token (MFU follows the counts run)
  eval_step = steps.make_eval_step(model, mesh=mesh)
  routing_step = steps.make_routing_step(model, mesh=mesh)
  acct = accounting.count(mc, dc.seq_len)
  config_json = cfg.to_json()
  writer = Writer(workdir, tc.steps, enabled=proc == 0, resume_step=start,
                  wandb_project=tc.wandb, config=json.loads(config_json) if tc.wandb else None)
  peak = peak_flops(tc.peak_flops) * n_dev
  if proc == 0:
    print(f"model: {acct['params_total']:,} params ({acct['params_active']:,} active/token), "
          f"{mc.executed_layers} executed layers; data: {dc.source}, batch {dc.batch_size} x "
          f"{dc.seq_len}; steps {start} -> {tc.steps} on {n_dev} device(s)"
          f"{_mesh_text(mesh)}; dispatch {run.dispatch} -> {resolve_backend(run.dispatch)}"
          f"{_exchange_text(run, mesh)}; attention {run.attention_impl} -> "
          f"{attention_impls.resolve(run.attention_impl, mc.dtype, None, mc.resolved_head_dim)}"
          f"{depth.describe(tc, mc.num_loops)}", flush=True)

  pending, val_loss, val_step = None, None, None
  t_log, tok_log, flops_log, t0 = time.time(), 0, 0.0, time.time()
  last_saved = start if mngr.latest_step() is not None else None

  def kept():
    return ('no checkpoint has been written yet' if last_saved is None else
            f'the last good checkpoint (step {last_saved}) is kept')

  replayed = 0.0  # steps replayed with dropless buffers since this process started the run

  def finish(pending):
    """Fetches a step's metrics (one step late) and stops on a non-finite loss."""
    nonlocal replayed
    s, m = pending
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    if 'replayed' in m:  # model.exchange_overflow='replay': logged as the count so far
      replayed += m['replayed']
      m['replayed'] = replayed
    watched = {k: m[k] for k in ('loss', 'objective', 'grad_norm') if k in m}
    if not all(map(math.isfinite, watched.values())):
      raise TrainingDiverged(
          f'non-finite values at step {s} ({watched}); stopped without saving: {kept()}. '
          'Lower train.lr or check the data.')
    losses.append(m['loss'])
    return s, m

  def handle(pending):
    nonlocal t_log, tok_log, flops_log, val_loss, val_step
    s, m = finish(pending)
    n = int(m.pop('loops'))
    if n not in step_flops:
      step_flops[n] = depth.step_flops_per_token(mc, dc.seq_len, n, depth.backprop(tc, n))
    tok_log += dc.batch_size * dc.seq_len  # this step's tokens, counted once it is finished
    flops_log += dc.batch_size * dc.seq_len * step_flops[n]
    if tc.sampled:  # this step's pass count, and the programs made so far
      m.update(loops=n, programs=len(programs))
    if s > tc.steps - tc.final_window:  # every step of the final window (the paired record)
      writer.record_step(s, m['loss'])
    if s % tc.log_every and s != tc.steps:
      return
    elapsed = max(time.time() - t_log, 1e-9)
    m['tokens_per_s'] = tok_log / elapsed
    if peak:
      m['mfu'] = flops_log / elapsed / peak
    if val and (s % tc.eval_every == 0 or s == tc.steps):
      with clock.spent('eval'):
        m['val_loss'] = val_loss = steps.evaluate(eval_step, state['params'], val, batch_sh,
                                                  state.get('router_bias'), dc.batch_size)
      val_step = s
    m.update(clock.row())
    writer.write(s, m)
    writer.progress(s, m)
    t_log, tok_log, flops_log = time.time(), 0, 0.0

  profiler = StepProfiler(tc.profile_range, storage.join(workdir, 'profile'), quiet=proc != 0)
  vote = preempt.Vote(mesh, tc.save_every_minutes)
  decision = preempt.Decision()
  caught.arm()  # from here a signal saves and stops (before: the default handlers)
  try:
    for step in range(start, tc.steps):
      with clock.spent('data'):
        batch = steps.put_batch(next(it), batch_sh, dc.batch_size)
      made = len(programs)
      n, train_step = programs.at(step)
      new = len(programs) > made
      if new and tc.sampled and proc == 0:
        print(f'step {step + 1}: {n} passes, compiling train program {len(programs)}',
              flush=True)
      t_step = time.perf_counter()
      timing = compile_cache.Timings()  # the first call traces and compiles (or loads)
      with (profiler.step(step + 1), clock.spent('compile') if new else contextlib.nullcontext(),
            timing if new else contextlib.nullcontext()):
        state, metrics = train_step(state, batch)
      if new and proc == 0:
        where = f'; cache {cache_dir}' if cache_dir and len(programs) == 1 else ''
        print(f'train program {len(programs)} ready in {time.perf_counter() - t_step:.2f} s '
              f'({timing.text()}{where})', flush=True)
      profiler.after(step + 1, metrics)
      checkpoint.check_background(mngr)  # an asynchronous save that failed stops the run
      if pending:
        handle(pending)
      if not new:
        clock.step(time.perf_counter() - t_step)  # dispatch to the previous step's end
      pending = (step + 1, dict(metrics, loops=n))
      if (step + 1) % tc.routing_every == 0:
        _write_routing(workdir, step + 1,
                       routing_step(state['params'], batch, state.get('router_bias')), proc)
      decision = vote(caught.signum)  # what every process does after this step
      if ((step + 1) % tc.save_every == 0 or decision.stop or decision.timed_save or
          step + 1 == tc.steps):
        handle(pending)
        pending = None
        if not bool(steps.all_finite(state['params'])):
          raise TrainingDiverged(
              f'non-finite parameters after step {step + 1}; stopped without saving: '
              f'{kept()}. Lower train.lr.')
        with clock.spent('save'):
          checkpoint.save(mngr, step + 1, state, {'iterator': it.get_state(),
                                                  'recent_losses': losses[-tc.final_window:]},
                          config_json)
        last_saved = step + 1
        vote.saved()
        if proc == 0:
          print(f'checkpoint step {step + 1} -> {mngr.directory}/{step + 1}'
                f'{" (writing in the background)" if tc.async_save else ""}', flush=True)
      if decision.stop:
        by = '' if caught.signum else ' (caught by another process)'
        print(f'{decision.stop}{by}: saved step {step + 1} and stopped', flush=True)
        break
    final = int(jax.device_get(state['step']))
    checkpoint.check_background(mngr, wait=True)
  finally:
    profiler.close()
    try:
      mngr.wait_until_finished()
    except Exception:  # pylint: disable=broad-except  (reported by check_background)
      pass
    writer.close()

  wall = time.time() - t0
  window = losses[-tc.final_window:]
  summary = {'steps': final, 'final_window_loss': float(np.mean(window)) if window else None,
             'final_window': len(window), 'final_loss': losses[-1] if losses else None,
             'val_loss': val_loss, 'val_step': val_step,  # the step val_loss was measured at
             'tokens_per_s': (final - start) * dc.batch_size * dc.seq_len /
             wall, 'wall_s': wall, 'params_total': acct['params_total'],
             'params_active': acct['params_active'], 'stopped_by': decision.stop,
             'replayed': replayed, 'compiled_programs': len(programs),
             **{k: v for k, v in clock.row().items() if not k.startswith('step_time')}}
  if proc == 0:
    storage.write_text(summary_path, json.dumps(summary, indent=1))
    print('summary: ' + json.dumps({k: summary[k] for k in
                                    ('steps', 'final_window_loss', 'val_loss', 'val_step',
                                     'tokens_per_s', 'compiled_programs')}))
  if tc.sample_tokens and not decision.stop:
    params, bias = state['params'], state.get('router_bias')
    if n_proc > 1:  # every process joins the gather; process 0 samples from the whole copy
      from jax.experimental import multihost_utils
      params, bias = multihost_utils.process_allgather((params, bias), tiled=True)
    if proc == 0:
      _print_sample(mc, params, dc, tc, bias, model.runtime)
  return summary


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


def _initial_state(mngr, target, model, tx, exp, state_sh, workdir, start_over=False):
  tc, dc = exp.train, exp.data
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
  return steps.create_state(model, tx, tc.seed, dc.seq_len, state_sh), None, 0


def _mesh_text(mesh) -> str:
  axes = [f'{a}={n}' for a, n in mesh.shape.items() if n > 1]
  return f" (mesh {' x '.join(axes)})" if axes else ''


def _write_routing(workdir, step, stats, proc):
  if proc:
    return
  stats = jax.device_get(stats)
  lines = []
  for seg, s in stats.items():
    lb = np.asarray(s['load_balance'])
    grid = lb.reshape(-1, lb.shape[-1]) if lb.ndim == 2 else lb.reshape(1, -1)
    for p in range(grid.shape[0]):
      for layer in range(grid.shape[1]):
        idx = (p, layer) if lb.ndim == 2 else (layer,)
        lines.append(json.dumps({'step': step, 'segment': seg, 'pass': p, 'layer': layer,
                                 **{k: float(np.asarray(v)[idx]) for k, v in s.items()}}))
  metrics_lib.append_lines(RunDir(workdir).file(ROUTING), lines)  # one step: one write


def _exchange_text(run, mesh) -> str:
  if mesh.shape['expert'] == 1:
    return ''
  return f', expert exchange {run.expert_exchange} -> {exchange_kind(run.expert_exchange)}'


def _print_sample(mc, params, dc, tc, router_bias, runtime):
  from loopmoe_jax.decode import generate
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
