"""train.profile_steps='A:B': a `jax.profiler` trace of train steps A..B-1 (1-based step numbers,
B - A steps) written under the run directory's `profile/`.

XLA's profiler writes `profile/plugins/profile/<time>/<host>.xplane.pb` (TensorBoard's profile
plugin: `pip install tensorboard tensorboard-plugin-profile`, then `tensorboard --logdir
RUN/profile`, tab Profile) and `<host>.trace.json.gz` beside it, a Chrome trace that Perfetto
opens (https://ui.perfetto.dev, "Open trace file"; nothing is uploaded), and
`perfetto_trace.json.gz`, the same for Perfetto. Each step is marked 'train' with its number. The trace starts before
step A's program is called and stops once step B-1's results are ready, so it holds those
steps' device work, and the data loading of steps A+1..B-1. Every process traces its own devices
(one file per host). A run resumed inside the range traces what is left of it; past it, nothing.
"""
from __future__ import annotations

import jax

from loopmoe_jax import storage


class StepProfiler:
  """Starts and stops the trace around the train steps of `steps` ((A, B) or None)."""

  def __init__(self, steps: tuple[int, int] | None, directory: str, quiet: bool = False):
    self.steps, self.directory, self.quiet, self.active = steps, directory, quiet, False

  def step(self, step: int):
    """A context around train step `step` (1-based): starts the trace at the range's first
    step, and marks the step (`jax.profiler.StepTraceAnnotation` 'train', step_num), which
    TensorBoard's profile plugin reads as the step boundaries."""
    self._start(step)
    return jax.profiler.StepTraceAnnotation('train', step_num=step)

  def _start(self, step: int) -> None:
    if self.steps and not self.active and self.steps[0] <= step < self.steps[1]:
      storage.makedirs(self.directory)
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
      self.active = True
      if not self.quiet:
        print(f'profiling steps {step}..{self.steps[1] - 1} -> {self.directory}', flush=True)

  def after(self, step: int, outputs) -> None:
    """Called after train step `step` with its outputs (waited for before the trace stops)."""
    if self.active and step >= self.steps[1] - 1:
      jax.block_until_ready(outputs)
      self.close()

  def close(self) -> None:
    if self.active:
      self.active = False
      jax.profiler.stop_trace()
      if not self.quiet:
        print(f'profile written: {self.directory} (tensorboard --logdir {self.directory}, or '
              'its *.trace.json.gz in https://ui.perfetto.dev)', flush=True)

