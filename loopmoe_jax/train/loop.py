"""The training loop of one run: its Job's steps over the data, metrics one step late, saves
and stops.

    loop = Loop(job, workdir, ..., start=step, state=state, data_state=...)
    summary = loop.run(caught)   # caught: preempt.StopSignals

A step's metrics are fetched after the next step is dispatched (`record`), so the host never
waits on the device between steps. After each step every process acts on the same decision
(preempt.Vote): save, stop, or go on (`after_step`, the one place a stop is handled). A
non-finite loss, gradient norm or parameters about to be saved raise TrainingDiverged; nothing
of them is written.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time

import jax
import numpy as np

from loopmoe_jax import accounting, distributed, storage, targets
from loopmoe_jax.data import pipeline
from loopmoe_jax.train import checkpoint, compile_cache, depth, preempt, step as steps
from loopmoe_jax.train import metrics as metrics_lib
from loopmoe_jax.train.goodput import Goodput
from loopmoe_jax.train.metrics import Writer
from loopmoe_jax.train.profile import StepProfiler
from loopmoe_jax.train.run import ROUTING, RunDir

log = logging.getLogger(__name__)

class TrainingDiverged(RuntimeError):
  pass


def peak_flops(cfg_peak: float) -> float:
  """Peak FLOP/s of one device: train.peak_flops, else the chip's row in targets.CHIPS."""
  if cfg_peak:
    return cfg_peak
  return targets.peak_flops(jax.devices()[0].device_kind, targets.devices_per_chip(jax.devices()))


class Window:
  """Tokens, model FLOPs and wall time since the last logged step (throughput and MFU)."""

  def __init__(self):
    self.start, self.tokens, self.flops = time.time(), 0, 0.0

  def add(self, tokens: int, flops: float):
    self.tokens += tokens
    self.flops += flops

  def rates(self, peak: float) -> dict:
    elapsed = max(time.time() - self.start, 1e-9)
    out = {'tokens_per_s': self.tokens / elapsed}
    if peak:
      out['mfu'] = self.flops / elapsed / peak
    return out


class Loop:
  """One run from `start` to train.steps (module docstring). Its counters: `losses` (the
  per-step losses of the final window, carried by checkpoints), `replayed` (steps replayed
  with dropless buffers since this process started), `val_loss` / `val_step`, `last_saved`."""

  def __init__(self, job, workdir: str, mngr, clock: Goodput, cache_dir, *, start: int, state,
               data_state: dict, config_json: str):
    exp, self.job, self.workdir, self.mngr = job.exp, job, workdir, mngr
    self.tc, self.dc = exp.train, exp.data
    self.clock, self.cache_dir, self.config_json = clock, cache_dir, config_json
    self.start, self.state, self.proc = start, state, jax.process_index()
    self.losses = list(data_state.get('recent_losses', []))
    rows = job.process_rows()
    self.it = pipeline.train_iterator(self.dc, exp.model.vocab_size,
                                      max(self.tc.steps, self.tc.total_steps) + 1, rows,
                                      data_state.get('iterator'))
    self.val = pipeline.validation_batches(self.dc, exp.model.vocab_size, rows)
    self.writer = Writer(workdir, self.tc.steps, enabled=self.proc == 0, resume_step=start,
                         wandb_project=self.tc.wandb,
                         config=json.loads(config_json) if self.tc.wandb else None)
    self.peak = peak_flops(self.tc.peak_flops) * jax.device_count()
    self.step_flops = {}  # pass count -> train FLOPs per token (MFU follows the counts run)
    self.window, self.t0 = Window(), time.time()
    self.replayed, self.val_loss, self.val_step = 0.0, None, None
    self.last_saved = start if mngr.latest_step() is not None else None
    self.pending, self.decision, self.lost = None, preempt.Decision(), False
    # the steps the summary's final-window loss averages (train.final_window, shrunk for a
    # run too short for it after its warmup: metrics.final_window)
    self.final_n, self.final_note = metrics_lib.final_window(self.tc.steps, self.tc.warmup,
                                                             self.tc.final_window)

  def kept(self) -> str:
    return ('no checkpoint has been written yet' if self.last_saved is None else
            f'the last good checkpoint (step {self.last_saved}) is kept')

  def run(self, caught: preempt.StopSignals) -> int:
    """Trains to train.steps or a stop; returns the state's step."""
    self.profiler = StepProfiler(self.tc.profile_range, storage.join(self.workdir, 'profile'),
                                 quiet=self.proc != 0)
    self.vote = preempt.Vote(self.job.mesh, self.tc.save_every_minutes)
    if self.final_note and self.proc == 0:
      log.info(self.final_note)
    try:
      for step in range(self.start, self.tc.steps):
        self.step(step)
        caught.arm()  # from the first step's dispatch (its program compiled) a signal saves
        # and stops; before it, the process's own handlers (a script's: exit at once)
        if self.after_step(step + 1, caught.signum):
          break
      final = int(jax.device_get(self.state['step']))
      checkpoint.check_background(self.mngr, wait=True)
    except Exception as e:  # pylint: disable=broad-except
      if jax.process_count() > 1 and distributed.lost_peer(e):  # nothing more to wait for
        self.lost = True
        raise distributed.PeerLost(distributed.lost_message(e, self.workdir)) from None
      raise
    finally:
      self.close()
    return final

  def step(self, step: int):
    """Dispatches train step `step` (0-based) and records the previous one's metrics."""
    with self.clock.spent('data'):
      batch = steps.put_batch(next(self.it), self.job.batch_sh, self.dc.batch_size)
    made = self.job.train_programs
    n, train_step = depth.train_step_at(self.job, step)
    new = self.job.train_programs > made
    if new and self.tc.sampled and self.proc == 0:
      print(f'step {step + 1}: {n} passes, compiling train program {made + 1}', flush=True)
    t_step = time.perf_counter()
    timing = compile_cache.Timings()  # the first call traces and compiles (or loads)
    with (self.profiler.step(step + 1),
          self.clock.spent('compile') if new else contextlib.nullcontext(),
          timing if new else contextlib.nullcontext()):
      self.state, metrics = train_step(self.state, batch)
    if new and self.proc == 0:
      where = f'; cache {self.cache_dir}' if self.cache_dir and made == 0 else ''
      print(f'train program {made + 1} ready in {time.perf_counter() - t_step:.2f} s '
            f'({timing.text()}{where})', flush=True)
    self.profiler.after(step + 1, metrics)
    checkpoint.check_background(self.mngr)  # an asynchronous save that failed stops the run
    if self.pending:
      self.record(self.pending)
    if not new:
      self.clock.step(time.perf_counter() - t_step)  # dispatch to the previous step's end
    self.pending = (step + 1, dict(metrics, loops=n))
    if (step + 1) % self.tc.routing_every == 0:
      routing = self.job.routing_step()(self.state['params'], batch,
                                        self.state.get('router_bias'))
      write_routing(self.workdir, step + 1, routing, self.proc)

  def after_step(self, step: int, signum: int) -> bool:
    """What every process does after `step` (1-based): save on schedule, on the clock, at the
    end or on a stop; True when the run stops here."""
    self.decision = self.vote(signum)
    if self.decision.stop and step == self.tc.steps:  # the run ends here anyway: finished
      self.decision = dataclasses.replace(self.decision, stop=None)
    if (step % self.tc.save_every == 0 or self.decision.stop or self.decision.timed_save or
        step == self.tc.steps):
      self.record(self.pending)
      self.pending = None
      self.save(step)
    if self.decision.stop:
      by = '' if signum else ' (caught by another process)'
      print(f'{self.decision.stop}{by}: saved step {step} and stopped (exit '
            f'{preempt.exit_status(self.decision.stop)}; re-run to resume)', flush=True)
    return bool(self.decision.stop)

  def fetch(self, pending) -> tuple[int, dict]:
    """A step's metrics as floats; stops on a non-finite loss or gradient norm."""
    s, m = pending
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    if 'replayed' in m:  # model.exchange_overflow='replay': logged as the count so far
      self.replayed += m['replayed']
      m['replayed'] = self.replayed
    watched = {k: m[k] for k in ('loss', 'objective', 'grad_norm') if k in m}
    if not all(map(math.isfinite, watched.values())):
      raise TrainingDiverged(
          f'non-finite values at step {s} ({watched}); stopped without saving: '
          f'{self.kept()}. Lower train.lr or check the data.')
    self.losses.append(m['loss'])
    return s, m

  def record(self, pending):
    """Fetches a finished step's metrics, counts its tokens and FLOPs, and logs the row (with
    the validation loss when due) every train.log_every steps and at the last."""
    tc, tokens = self.tc, self.dc.batch_size * self.dc.seq_len
    s, m = self.fetch(pending)
    n = int(m.pop('loops'))
    if n not in self.step_flops:
      self.step_flops[n] = depth.step_flops_per_token(self.job.exp.model, self.dc.seq_len, n,
                                                      depth.backprop(tc, n))
    self.window.add(tokens, tokens * self.step_flops[n])  # counted once it is finished
    if tc.sampled:  # this step's pass count, and the programs made so far
      m.update(loops=n, programs=self.job.train_programs)
    if s > tc.steps - tc.final_window:  # every step of the final window (the paired record)
      self.writer.record_step(s, m['loss'])
    if s % tc.log_every and s != tc.steps:
      return
    m.update(self.window.rates(self.peak))
    if self.val and (s % tc.eval_every == 0 or s == tc.steps):
      m['val_loss'] = self.evaluate()
      self.val_step = s
    m.update(self.clock.row())
    self.writer.write(s, m)
    self.writer.progress(s, m)
    self.window = Window()

  def evaluate(self) -> float:
    """The validation loss of the current parameters."""
    with self.clock.spent('eval'):
      self.val_loss = steps.evaluate(self.job.eval_step(), self.state['params'], self.val,
                                     self.job.batch_sh, self.state.get('router_bias'),
                                     self.dc.batch_size)
    return self.val_loss

  def save(self, step: int):
    """Writes checkpoint `step` (the state, the data iterator, the final window's losses);
    non-finite parameters are never written."""
    if not self.job.all_finite(self.state['params']):
      raise TrainingDiverged(f'non-finite parameters after step {step}; stopped without '
                             f'saving: {self.kept()}. Lower train.lr.')
    with self.clock.spent('save'):
      checkpoint.save(self.mngr, step, self.state,
                      {'iterator': self.it.get_state(),
                       'recent_losses': self.losses[-self.tc.final_window:]}, self.config_json,
                      checksum=self.job.checksum_program())
    self.last_saved = step
    self.vote.saved()
    if self.proc == 0:
      print(f'checkpoint step {step} -> {self.mngr.directory}/{step}'
            f'{" (writing in the background)" if self.tc.async_save else ""}', flush=True)

  def close(self):
    """Ends the profile, waits for a save in flight (not when a peer is lost: it would wait
    for the lost process) and closes the writers."""
    self.profiler.close()
    try:
      if not self.lost:
        self.mngr.wait_until_finished()
    except Exception:  # pylint: disable=broad-except  (reported by check_background)
      pass
    self.writer.close()

  def summary(self, final: int) -> dict:
    """The run's summary.json: steps, final-window loss (the mean of the last `final_window`
    steps' losses; `final_window_note` says why that is not train.final_window, else None),
    validation loss, throughput, time."""
    wall, window = time.time() - self.t0, self.losses[-self.final_n:]
    acct = accounting.count(self.job.exp.model, self.dc.seq_len)
    return {'steps': final, 'final_window_loss': float(np.mean(window)) if window else None,
            'final_window': len(window), 'final_window_note': self.final_note,
            'final_loss': self.losses[-1] if self.losses else None,
            'val_loss': self.val_loss, 'val_step': self.val_step,  # the step val_loss is of
            'tokens_per_s': (final - self.start) * self.dc.batch_size * self.dc.seq_len / wall,
            'wall_s': wall, 'params_total': acct['params_total'],
            'params_active': acct['params_active'], 'stopped_by': self.decision.stop,
            'replayed': self.replayed, 'compiled_programs': self.job.train_programs,
            **{k: v for k, v in self.clock.row().items() if not k.startswith('step_time')}}


def write_routing(workdir, step, stats, proc):
  """One line per segment, pass and layer of a step's routing statistics (process 0)."""
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
