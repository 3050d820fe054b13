"""The persistent compilation cache of a run: a restart (a preempted pod, a resumed run, each
pass count a sampled-depth run compiles) loads its programs instead of compiling them again.

`train.compile_cache`: '' (default) a directory `compile_cache/` in the workdir (on cloud
storage too: JAX reads and writes the cache through its own path layer), a path of your
choice, or 'off'. A cache directory already configured for the process (JAX_COMPILATION_CACHE_DIR,
or jax.config) is kept. JAX's cache key covers what changes the program: the lowered program,
the compile options, the devices and mesh, the XLA flags and the jax/jaxlib/backend versions;
a hit loads the executable that compiling the same program gives, so results are unchanged.
Every program is kept, however fast it compiled (sampled-depth runs compile many small ones).
"""
from __future__ import annotations

import contextlib
import os

import jax
from jax._src import compilation_cache  # off(): jax has no public reset of its cache

SUBDIR = 'compile_cache'


def resolve(setting: str, workdir: str) -> str | None:
  """The cache directory for `train.compile_cache` in `workdir` (None: off)."""
  if setting == 'off':
    return None
  if setting:
    return setting
  return workdir.rstrip('/') + '/' + SUBDIR if '://' in workdir else os.path.join(workdir, SUBDIR)


def use(setting: str, workdir: str) -> str | None:
  """Points JAX's persistent compilation cache at the run's directory (module docstring) and
  returns the directory in use (None: off)."""
  configured = jax.config.jax_compilation_cache_dir
  if configured:  # the process's own choice (an environment variable, the test suite)
    return configured
  path = resolve(setting, workdir)
  if path is None:
    return None
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=import-outside-toplevel
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  if '://' in path:  # eviction locks a local file beside the cache: none on object storage
    jax.config.update('jax_compilation_cache_max_size', -1)
  compilation_cache.set_cache_dir(path)
  compilation_cache.reset_cache()  # a cache this process initialised before is re-opened here
  return path


_PHASES = {'/jax/core/compile/jaxpr_trace_duration': 'trace',
           '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower',
           '/jax/core/compile/backend_compile_duration': 'compile'}  # a cache read included
_HIT = '/jax/compilation_cache/cache_hits'


class Timings:
  """While entered, the seconds JAX spends tracing, lowering and compiling programs (a cache
  hit's read counted as compiling) and its cache hits, from jax.monitoring's events."""

  def __init__(self):
    self.seconds = dict.fromkeys(_PHASES.values(), 0.0)
    self.hits = 0

  def _duration(self, event, duration, **kwargs):
    del kwargs
    if event in _PHASES:
      self.seconds[_PHASES[event]] += duration

  def _event(self, event, **kwargs):
    del kwargs
    self.hits += event == _HIT

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._duration)
    jax.monitoring.register_event_listener(self._event)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._duration)
    jax.monitoring.unregister_event_listener(self._event)

  def text(self) -> str:
    parts = ', '.join(f'{k} {v:.2f} s' for k, v in self.seconds.items())
    return f'{parts}{f", {self.hits} from the compile cache" if self.hits else ""}'


@contextlib.contextmanager
def off():
  """A compile that must run the compiler: a cache hit writes no XLA dump, and a program for
  compile-only devices cannot be read back from jax's persistent cache. jax decides once per
  process whether its persistent cache is in use; its reset makes it decide again."""
  old = jax.config.jax_enable_compilation_cache
  jax.config.update('jax_enable_compilation_cache', False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update('jax_enable_compilation_cache', old)
    compilation_cache.reset_cache()
