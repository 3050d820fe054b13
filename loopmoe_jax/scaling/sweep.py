"""Sweeps from configs: one run per grid point, each in its own workdir, collected as a CSV.

    rows = run_sweep(cfg, {'model.num_loops': [1, 2, 4]}, '/tmp/sweep')

A sweep key is a dotted path of the experiment ConfigDict (`model.num_loops`,
`train.steps`, ...); values are converted to the type of the field they replace. One alias:
`model.num_experts` sets the expert count of every MoE segment (prelude, core and coda
`*_experts` fields that are non-zero in the base config; dense segments stay dense), so that
an experts axis means the same thing whatever the layout. Seeds (`train.seed`, `data.seed`)
cannot be swept: every point shares the data order and the init seed of the base config (the
data order never depends on the model).

Points run one after another in `ROOT/<key=value,...>/`. A point whose `summary.json` reports
the configured steps (and a loss) is skipped; any other point is (re)run with the trainer,
which resumes from its newest checkpoint. The collected rows -- N_stored (every stored param),
N_active_pass (active params per token of one pass), N_active_executed (active params per
token over every executed pass), N_block_stored, N_block_active (the looped block's, one pass),
D (tokens), C (training FLOPs = 3 x forward FLOPs/token x D), F
(forward FLOPs/token), S (sparsity), r (passes), E (core experts), k (top-k), loss (final
window) -- are written to ROOT/sweep.csv, ready for `fit_laws.py`.

Memory: in a one-process sweep each point trains in a child process (`isolate`), so what a
point compiles and allocates -- programs, arrays, the compiler's own heap -- goes when it ends
and the sweep's memory is one point's however many points it has. SIGTERM to the sweep
reaches the point (it saves and stops; re-running resumes); Ctrl-C reaches it through the
terminal. A multi-process sweep runs its points in-process (every process joins each point's
collectives); a point's programs belong to its Job (loopmoe_jax/job.py) and go when it ends.
"""
from __future__ import annotations

import copy
import ctypes
import gc
import importlib.util
import itertools
import json
import multiprocessing
import os
import resource
import signal
import threading
from typing import Any, Callable, Mapping, Sequence

import jax

from loopmoe_jax import cli, storage
from loopmoe_jax.accounting import count
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.experiment import RUN_SETTINGS, build, config_diff
from loopmoe_jax.scaling.data import write_csv
from loopmoe_jax.train.run import RunDir
from loopmoe_jax.train.trainer import train

EXPERTS_ALIAS = 'model.num_experts'
EXPERT_FIELDS = ('prelude_experts', 'core_experts', 'coda_experts')
FROZEN = ('train.seed', 'data.seed')


def parse_sweeps(specs: Sequence[str]) -> dict[str, list[str]]:
  """['model.num_loops=1,2,4', ...] -> {'model.num_loops': ['1', '2', '4'], ...}."""
  out = {}
  for spec in specs:
    key, eq, vals = spec.partition('=')
    values = [v.strip() for v in vals.split(',') if v.strip()]
    if not eq or not values:
      raise ValueError(f'--sweep {spec!r}: expected SECTION.FIELD=v1,v2,...')
    out[key.strip()] = values
  return out


def config_sweep(path: str, arg: str | None = None) -> dict[str, list]:
  """The grid a config file carries in `get_sweep(arg)` (empty when it has none)."""
  spec = importlib.util.spec_from_file_location('_sweep_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  get = getattr(module, 'get_sweep', None)
  return dict(get(arg) if get else {})


def _convert(old: Any, value: Any, key: str):
  """value (a string from the command line, or a Python value) as the type of the field's
  current value; a ValueError naming the key when it is not one."""
  if isinstance(old, str) or old is None:
    return value
  if isinstance(old, bool):
    if isinstance(value, str):
      if value.lower() not in ('1', 'true', 'yes', '0', 'false', 'no'):
        raise ValueError(f'--sweep {key}: {value!r} is not a bool')
      return value.lower() in ('1', 'true', 'yes')
    return bool(value)
  try:
    number = float(value)
  except (TypeError, ValueError):
    raise ValueError(f'--sweep {key}: {value!r} is not a number ({type(old).__name__} '
                     'field)') from None
  if isinstance(old, int):
    if not number.is_integer():
      raise ValueError(f'--sweep {key}: {value!r} is not an integer')
    return int(number)
  return type(old)(number)


# fields that may differ between a point's runs (cadence, length, threads): not a new point
FREE_FIELDS = tuple(f'train.{k}' for k in (
    'steps', 'log_every', 'eval_every', 'save_every', 'keep', 'async_save', 'routing_every',
    'sample_tokens', 'sample_prompt', 'peak_flops')) + ('data.num_threads',
                                                        'data.prefetch') + RUN_SETTINGS


def config_changes(workdir: str, cfg) -> list[str]:
  """The fields (other than FREE_FIELDS) where the config a point ran with (its config.json)
  differs from cfg."""
  path = storage.join(workdir, 'config.json')
  if not storage.exists(path):
    return []
  stored = json.loads(storage.read_text(path))
  return [f'{k}: {old!r} then, {new!r} now' for k, old, new in config_diff(stored, build(cfg))
          if k not in FREE_FIELDS]


def apply_point(cfg, point: Mapping[str, Any]):
  """A copy of the experiment ConfigDict with the point's fields set."""
  cfg = copy.deepcopy(cfg)
  for key, value in point.items():
    if key in FROZEN:
      raise ValueError(f'--sweep {key}: seeds are shared by every point of a sweep')
    if key == EXPERTS_ALIAS:
      fields = [f for f in EXPERT_FIELDS if cfg.model[f]] or ['core_experts']
      for f in fields:
        cfg.model[f] = _convert(cfg.model[f], value, key)
      continue
    *path, leaf = key.split('.')
    node = cfg
    for part in path:
      if part not in node:
        raise ValueError(f'--sweep {key}: config has no section {part!r}')
      node = node[part]
    if leaf not in node:
      raise ValueError(f'--sweep {key}: no field {leaf!r}; known {sorted(node.keys())}')
    node[leaf] = _convert(node[leaf], value, key)
  return cfg


def grid(sweeps: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
  keys = list(sweeps)
  return [dict(zip(keys, vals)) for vals in itertools.product(*(sweeps[k] for k in keys))]


def release_jax_caches():
  """After an in-process point: jax's own caches (the eager operations of each shape a point
  used; the point's programs went with its Job) and the heap pages glibc keeps, so the
  sweep's memory stays that of one point."""
  jax.clear_caches()
  gc.collect()
  try:
    ctypes.CDLL('libc.so.6').malloc_trim(0)
  except (OSError, AttributeError):
    pass


def point_name(point: Mapping[str, Any]) -> str:
  return ','.join(f'{k.split(".")[-1]}={v}' for k, v in point.items()) or 'base'


def block_params(mc: ModelConfig, key: str = 'params_total') -> int:
  """Params of the looped block (stored with params_total; active per token of one pass with
  params_active): one pass of the model minus the model without its core."""
  if not mc.core_layers:
    return 0
  once = count(mc.replace(num_loops=1))
  try:
    rest = count(mc.replace(core_layers=0, num_loops=1, injection='none'))[key]
  except ValueError:  # the core is the whole model: everything but embeddings/final norm
    nonembedding = 'params_active_nonembedding' if key == 'params_active' else \
        'params_nonembedding'
    return once[nonembedding] - (mc.d_model if mc.norm_gain else 0)
  return once[key] - rest


def point_row(cfg, summary: Mapping[str, Any]) -> dict[str, Any]:
  """The law's columns for one finished point."""
  mc = ModelConfig.from_dict(cfg.model)
  acct = count(mc, cfg.data.seq_len)
  tokens = summary['steps'] * cfg.data.batch_size * cfg.data.seq_len
  once = count(mc.replace(num_loops=1), cfg.data.seq_len)
  return {'N_stored': acct['params_total'], 'N_active_pass': once['params_active'],
          'N_active_executed': acct['params_active'], 'N_block_stored': block_params(mc),
          'N_block_active': block_params(mc, 'params_active'), 'D': tokens, 'C': 3 * acct['flops_per_token'] * tokens,
          'F': acct['flops_per_token'], 'S': acct['sparsity'], 'r': mc.num_loops,
          'E': mc.core_experts, 'k': mc.top_k if mc.core_experts else 0,
          'loss': summary['final_window_loss'], 'steps': summary['steps']}


def finished(workdir: str, steps: int) -> dict | None:
  """The summary of a run that reached `steps` with a loss, else None."""
  s = RunDir(workdir).summary()
  ok = s is not None and s.get('steps', 0) >= steps and s.get('final_window_loss') is not None
  return s if ok else None


def resident_bytes() -> int:
  """This process's resident memory now (Linux /proc; 0 where it is not readable)."""
  try:
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
  except (OSError, ValueError, IndexError):
    return 0


def peak_resident_bytes() -> int:
  """This process's largest resident memory so far (Linux reports kilobytes)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# what the sweep's process set for JAX that a child would not read from the environment
INHERITED_JAX_CONFIG = ('jax_platforms', 'jax_num_cpu_devices', 'jax_enable_x64',
                        'jax_default_matmul_precision', 'jax_threefry_partitionable')


def _train_point(c, workdir: str, jax_config: Mapping[str, Any], conn,
                 log_to_stderr: bool = False) -> None:
  """A child process's work: train one point, send back (summary, peak RSS) or the error. Its
  library warnings and notes are printed as the sweep's own are (`log_to_stderr`: the sweep
  ran from a script, cli.run)."""
  try:
    if log_to_stderr:
      cli.log_to_stderr()
    import jax  # pylint: disable=import-outside-toplevel
    for name, value in jax_config.items():
      jax.config.update(name, value)
    conn.send(('summary', train(c, workdir), peak_resident_bytes()))
  except BaseException as e:  # pylint: disable=broad-except
    plain = isinstance(e, (ValueError, RuntimeError, OSError)) and str(e)
    conn.send(('error', str(e) if plain else f'{type(e).__name__}: {e}', peak_resident_bytes()))
  finally:
    conn.close()


def train_isolated(c, workdir: str) -> tuple[dict, int]:
  """Trains one point in a fresh child process; returns (its summary, the child's peak RSS).
  A child that dies without a word (killed, out of memory) is a RuntimeError naming its exit
  status; its checkpoints stay, so re-running the sweep resumes it."""
  import jax  # pylint: disable=import-outside-toplevel
  jax_config = {name: getattr(jax.config, name) for name in INHERITED_JAX_CONFIG}
  ctx = multiprocessing.get_context('spawn')
  receive, send = ctx.Pipe(duplex=False)
  child = ctx.Process(target=_train_point, args=(c, workdir, jax_config, send,
                                                 cli.logs_to_stderr()), daemon=False)
  main = threading.current_thread() is threading.main_thread()
  if main:  # SIGTERM to the sweep stops the point (which saves); Ctrl-C reaches it directly
    old = {signal.SIGTERM: signal.getsignal(signal.SIGTERM),
           signal.SIGINT: signal.getsignal(signal.SIGINT)}
    signal.signal(signal.SIGTERM, lambda signum, frame: child.pid and os.kill(child.pid, signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    child.start()
    send.close()
    try:
      kind, value, peak = receive.recv()
    except EOFError:
      kind, value, peak = 'died', None, 0
    child.join()
  finally:
    if main:
      for signum, handler in old.items():
        signal.signal(signum, handler)
  if kind == 'error':
    raise RuntimeError(value)
  if kind == 'died':
    raise RuntimeError(f'the process training {workdir} died (exit status {child.exitcode}); '
                       're-run the sweep to resume it')
  return value, peak


def run_sweep(cfg, sweeps: Mapping[str, Sequence[Any]], root: str,
              run: Callable[[Any, str], dict] | None = None, log=print,
              isolate: bool | None = None) -> list[dict]:
  """Runs (or skips, or resumes) every grid point, one after another (in a multi-process run
  every process runs each point together; process 0 alone writes the sweep's files); returns
  the rows and writes sweep.csv. `isolate` (default: with the trainer in a one-process run)
  trains each point in a child process (spawned: a script that calls this needs the usual
  `if __name__ == '__main__':` guard, as the project's scripts have); `run` replaces the
  trainer (in-process)."""
  import jax  # pylint: disable=import-outside-toplevel
  writer = jax.process_index() == 0
  if isolate is None:
    isolate = run is None and jax.process_count() == 1
  if isolate and (run is not None or jax.process_count() > 1):
    raise ValueError('isolate: points run in child processes with the trainer, in a '
                     'one-process sweep only')
  if run is None:
    run = train
  points = grid(sweeps)
  cfgs = [apply_point(cfg, p) for p in points]
  for point, c in zip(points, cfgs):  # fail on a bad point before any training
    try:
      build(c)
    except ValueError as e:
      raise ValueError(f'sweep point {point_name(point)}: {e}') from None
  storage.makedirs(root)
  rows = []
  for i, (point, c) in enumerate(zip(points, cfgs)):
    name = point_name(point)
    workdir = storage.join(root, name)
    summary = finished(workdir, c.train.steps)
    changes = config_changes(workdir, c)
    if changes:
      raise ValueError(f'sweep point {name} in {workdir} ran with another config ('
                       + '; '.join(changes[:8]) + '); use a new --root or remove it')
    if summary:
      log(f'[{i + 1}/{len(points)}] {name}: finished ({summary["steps"]} steps), skipped')
    else:
      log(f'[{i + 1}/{len(points)}] {name}: running in {workdir}')
      if writer:
        storage.makedirs(workdir)
        storage.write_text(storage.join(workdir, 'point.json'), json.dumps(point))
        storage.write_text(storage.join(workdir, 'config.json'), c.to_json())
      if isolate:
        summary, peak = train_isolated(c, workdir)
      else:
        summary, peak = run(c, workdir), None  # its Job, and so its programs, go with it
        release_jax_caches()
      if summary.get('stopped_by') or summary.get('final_window_loss') is None:
        log(f'{name}: stopped before the end; re-run the sweep to resume')
        break
      log(f'[{i + 1}/{len(points)}] {name}: loss {summary["final_window_loss"]:.4f}, '
          f'rss {resident_bytes() / 2**30:.2f} GiB'
          + (f' (point\'s process peak {peak / 2**30:.2f} GiB)' if peak else ''))
    rows.append({'point': name, **{k: point[k] for k in point}, **point_row(c, summary),
                 'workdir': workdir})
  if rows and writer:
    write_csv(storage.join(root, 'sweep.csv'), rows)
  return rows
