"""Stops and timed saves that every process of a run agrees on.

A signal (SIGTERM at a pod's maintenance event, SIGINT) reaches the hosts of a multi-host run
at different times, or only one of them. A process that acted on its own signal would wait in
the checkpoint's barrier while the others enter the next step's collectives: the run hangs. So
no process acts on its own flags. Each step every process posts them to `Vote`: the signal it
caught (its number; 0 for none) and, on process 0 alone, whether `train.save_every_minutes`
have passed since the last save (one clock decides). A tiny program takes their maximum over
every device of the mesh (one all-reduce of two int32); its result is read one step later,
beside the step's metrics the trainer already waits for, so every process acts on the same
decision after the same step: all save that step, and all stop. With one process the flags are
the decision, at once (no program).

    with StopSignals() as caught:
      vote = Vote(mesh, save_every_minutes=30)
      caught.arm()
      for step ...:
        ... dispatch the train step ...
        decision = vote(caught.signum)    # the agreement on the flags posted a step ago
        if decision.stop: save, then break

A run stopped so ends with the signal's exit status (`exit_status`: 130 SIGINT, 143 SIGTERM,
as a shell reports a command the signal ended) on every process, once it has saved: the
scripts return it, so `train.py ... && evaluate.py ...` does not go on after a stop.
"""
from __future__ import annotations

import dataclasses
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


def exit_status(stopped_by: str | None) -> int:
  """The exit status of a run stopped by the named signal (a summary's `stopped_by`):
  128 + its number (SIGINT 130, SIGTERM 143); 0 for None (the run ended)."""
  return 128 + signal.Signals[stopped_by].value if stopped_by else 0


def stop_signal(status: int | None) -> str | None:
  """The stop signal ('SIGINT', 'SIGTERM') a child process's exit status reports: killed by
  it (-N), or exited with its shell status (128 + N: a script's exit at once); else None."""
  for sig in (signal.SIGINT, signal.SIGTERM):
    if status in (-sig, 128 + sig):
      return sig.name
  return None


class Stopped(SystemExit):
  """Work that a signal stopped once it had saved what it had (a sweep: its finished `rows`
  and `csv`, the keyword arguments): raised, it ends a script with the signal's exit status
  (`code`, exit_status); a caller may catch it."""

  def __init__(self, signal_name: str, **left):
    super().__init__(exit_status(signal_name))
    self.signal = signal_name
    self.__dict__.update(left)


class StopSignals:
  """Once armed (the training loop dispatched its first step), catches SIGTERM and SIGINT
  until the context exits (the run's summary written; main thread only): `signum` is the
  first one caught (0: none). A SIGINT after a signal was caught (a second Ctrl-C while the
  run saves) raises KeyboardInterrupt: a script exits at once with status 130 (cli). The
  previous handlers come back on exit."""

  def __init__(self):
    self.signum = 0
    self._old = {}

  def __enter__(self):
    return self

  def arm(self):
    if threading.current_thread() is threading.main_thread() and not self._old:
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._set)

  def _set(self, signum, frame):
    del frame
    if self.signum and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signum = self.signum or signum

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)
    self._old = {}


@dataclasses.dataclass(frozen=True)
class Decision:
  """What every process does after this step: stop (the name of the signal some process
  caught; None: go on), and save now on the clock (`train.save_every_minutes`)."""
  stop: str | None = None
  timed_save: bool = False


def _name(signum: int) -> str | None:
  return signal.Signals(signum).name if signum else None


class Vote:
  """The per-step agreement (module docstring). `collective=None`: a program over the mesh
  when the run has several processes, the local flags at once otherwise; True forces the
  program (the benchmark measures its cost on one process)."""

  def __init__(self, mesh, save_every_minutes: float = 0.0, collective: bool | None = None,
               clock=time.monotonic):
    self.every_s = save_every_minutes * 60.0
    self.clock, self.last_save, self.saves = clock, clock(), 0
    self.collective = jax.process_count() > 1 if collective is None else collective
    self._pending = None
    if self.collective:
      self._sh = NamedSharding(mesh, P(mesh.axis_names, None))
      self._n = mesh.size
      self._agree = jax.jit(lambda x_ND: jnp.max(x_ND, axis=0),
                            out_shardings=NamedSharding(mesh, P()))

  def saved(self):
    """A checkpoint was written: the clock of timed saves starts again (and a timed save
    posted before it is void)."""
    self.last_save, self.saves = self.clock(), self.saves + 1

  def _flags(self, signum: int) -> np.ndarray:
    due = (self.every_s > 0 and jax.process_index() == 0 and
           self.clock() - self.last_save >= self.every_s)
    return np.array([signum, int(due)], np.int32)

  def __call__(self, signum: int) -> Decision:
    """Posts this process's flags; returns the decision every process reaches now."""
    flags = self._flags(signum)
    if not self.collective:
      return Decision(_name(int(flags[0])), bool(flags[1]))
    x_ND = jax.make_array_from_callback((self._n, 2), self._sh,
                                        lambda idx: flags[None].repeat(len(range(self._n)[idx[0]]), 0))
    previous, self._pending = self._pending, (self._agree(x_ND), self.saves)
    if previous is None:
      return Decision()
    agreed = np.asarray(jax.device_get(previous[0]))
    return Decision(_name(int(agreed[0])), bool(agreed[1]) and previous[1] == self.saves)
