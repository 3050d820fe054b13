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
(forward FLOPs/token), S (sparsity), r (passes), E (core experts), k (top-k), loss (the summary's
final_window_loss: the mean LM loss of the last loss_steps steps, train.final_window or, for
a run too short for it after train.warmup, the steps after the warmup), loss_steps, steps --
are written to ROOT/sweep.csv, ready for `fit_laws.py`. A signal that stops a point (it
saves) stops the sweep: the CSV holds the points that had finished, and the sweep ends with
the signal's exit status (preempt.Stopped: 130 SIGINT, 143 SIGTERM); re-running resumes.

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
import difflib
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
from loopmoe_jax.train import preempt
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
    'sample_tokens', 'sample_prompt', 'peak_flops', 'compile_cache')) + ('data.num_threads',
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
    parts, node = key.split('.'), cfg
    for depth, part in enumerate(parts):
      if not hasattr(node, 'keys'):
        raise ValueError(f'--sweep {key}: {".".join(parts[:depth])} is a field, not a section')
      if part not in node:
        what = 'no field' if depth == len(parts) - 1 else 'config has no section'
        raise ValueError(f'--sweep {key}: {what} {part!r}' + _near(key, cfg))
      if depth < len(parts) - 1:
        node = node[part]
    node[parts[-1]] = _convert(node[parts[-1]], value, key)
  return cfg


def _near(key: str, cfg) -> str:
  """'; did you mean A or B?' for the sweep keys near `key` (difflib over every field of the
  config and the model.num_experts alias; for a key without its section, the fields of that
  name), else what a key is."""
  keys = [EXPERTS_ALIAS]
  stack = [('', cfg)]
  while stack:
    prefix, node = stack.pop()
    for k, v in node.items():
      (stack.append((f'{prefix}{k}.', v)) if hasattr(v, 'keys') else keys.append(prefix + k))
  near = (difflib.get_close_matches(key, keys, n=3, cutoff=0.75) or
          [k for k in keys if k.rsplit('.', 1)[-1] == key.rsplit('.', 1)[-1]][:3])
  if near:
    return f'; did you mean {" or ".join(near)}?'
  return f' (a sweep key is a config field, SECTION.FIELD, or {EXPERTS_ALIAS})'


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
  """The law's columns for one finished point (`loss`: its final_window_loss, the mean
  LM loss of its last `loss_steps` steps, metrics.final_window)."""
  mc = ModelConfig.from_dict(cfg.model)
  acct = count(mc, cfg.data.seq_len)
  tokens = summary['steps'] * cfg.data.batch_size * cfg.data.seq_len
  once = count(mc.replace(num_loops=1), cfg.data.seq_len)
  return {'N_stored': acct['params_total'], 'N_active_pass': once['params_active'],
          'N_active_executed': acct['params_active'], 'N_block_stored': block_params(mc),
          'N_block_active': block_params(mc, 'params_active'), 'D': tokens, 'C': 3 * acct['flops_per_token'] * tokens,
          'F': acct['flops_per_token'], 'S': acct['sparsity'], 'r': mc.num_loops,
          'E': mc.core_experts, 'k': mc.top_k if mc.core_experts else 0,
          'loss': summary['final_window_loss'], 'loss_steps': summary.get('final_window'),
          'steps': summary['steps']}


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
  library warnings and notes are printed as the sweep's own are, and a Ctrl-C before its loop
  exits at once (`log_to_stderr`: the sweep ran from a script, cli.run)."""
  try:
    if log_to_stderr:
      cli.log_to_stderr()
      cli.exit_on_interrupt()
    import jax  # pylint: disable=import-outside-toplevel
    for name, value in jax_config.items():
      jax.config.update(name, value)
    conn.send(('summary', train(c, workdir), peak_resident_bytes()))
  except KeyboardInterrupt:  # a Ctrl-C before the loop caught it: nothing saved
    conn.send(('summary', {'stopped_by': 'SIGINT'}, peak_resident_bytes()))
  except BaseException as e:  # pylint: disable=broad-except
    plain = isinstance(e, (ValueError, RuntimeError, OSError)) and str(e)
    conn.send(('error', str(e) if plain else f'{type(e).__name__}: {e}', peak_resident_bytes()))
  finally:
    conn.close()


def train_isolated(c, workdir: str) -> tuple[dict, int]:
  """Trains one point in a fresh child process; returns (its summary, the child's peak RSS).
  A child that a stop signal ended before it wrote a summary returns {'stopped_by': NAME}.
  One that dies otherwise without a word (killed, out of memory) is a RuntimeError naming
  its exit status; its checkpoints stay, so re-running the sweep resumes it."""
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
  if kind == 'died' and preempt.stop_signal(child.exitcode):
    return {'stopped_by': preempt.stop_signal(child.exitcode)}, peak
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
  trainer (in-process). A point stopped by a signal stops the sweep: the points that had
  finished (before it, and after it from an earlier invocation) go to sweep.csv, then
  preempt.Stopped (its `rows`, and `csv`: the path, or None when none had finished). `root` that cannot be a directory is a ValueError before any work."""
  import jax  # pylint: disable=import-outside-toplevel
  cli.check_output_dir('--root', root)
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
  for c in cfgs:  # one compile cache for the sweep: points of one program compile once
    c.train.compile_cache = c.train.compile_cache or storage.join(root, 'compile_cache')
  for point, c in zip(points, cfgs):  # fail on a bad point before any training
    try:
      build(c)
    except ValueError as e:
      raise ValueError(f'sweep point {point_name(point)}: {e}') from None
  storage.makedirs(root)
  rows, stopped = [], None  # stopped: (signal name, point name)
  for i, (point, c) in enumerate(zip(points, cfgs)):
    name, at = point_name(point), f'[{i + 1}/{len(points)}]'
    workdir = storage.join(root, name)
    summary = finished(workdir, c.train.steps)
    changes = config_changes(workdir, c)
    if changes:
      raise ValueError(f'sweep point {name} in {workdir} ran with another config ('
                       + '; '.join(changes[:8]) + '); use a new --root or remove it')
    if summary:
      log(f'{at} {name}: finished ({summary["steps"]} steps), skipped')
    elif stopped:
      continue
    else:
      log(f'{at} {name}: running in {workdir}')
      summary = _run_point(point, c, workdir, run if not isolate else None, writer)
      if summary.get('stopped_by'):
        stopped = (summary['stopped_by'], name)
        continue
      log(f'{at} {name}: loss {summary["final_window_loss"]:.4f} (its last '
          f'{summary.get("final_window")} steps), rss {resident_bytes() / 2**30:.2f} GiB'
          + (f' (point\'s process peak {summary["peak"] / 2**30:.2f} GiB)'
             if summary.get('peak') else ''))
    rows.append({'point': name, **{k: point[k] for k in point}, **point_row(c, summary),
                 'workdir': workdir})
  csv = storage.join(root, 'sweep.csv') if rows else None
  if rows and writer:
    write_csv(csv, rows)
  if stopped:
    _stop(stopped, rows, csv, len(points), log)
  return rows


def _run_point(point, c, workdir: str, run, writer: bool) -> dict:
  """Trains one point (in a child process when `run` is None); its summary, with the child's
  peak RSS as 'peak'. A run that ends without a loss, unstopped, is a RuntimeError."""
  if writer:
    storage.makedirs(workdir)
    storage.write_text(storage.join(workdir, 'point.json'), json.dumps(point))
    storage.write_text(storage.join(workdir, 'config.json'), c.to_json())
  if run is None:
    summary, peak = train_isolated(c, workdir)
  else:
    summary, peak = run(c, workdir), None  # its Job, and so its programs, go with it
    release_jax_caches()
  if not summary.get('stopped_by') and summary.get('final_window_loss') is None:
    raise RuntimeError(f'sweep point {point_name(point)} in {workdir} ended without a '
                       'final-window loss; re-run the sweep')
  return dict(summary, peak=peak)


def _stop(stopped: tuple[str, str], rows: list[dict], csv: str | None, total: int, log):
  """Says what an interrupted sweep leaves (one line) and raises preempt.Stopped."""
  signame, name = stopped
  status = preempt.exit_status(signame)
  left = (f'wrote {csv} with the {len(rows)} of {total} points that have finished' if csv else
          'no point has finished: no sweep.csv written')
  log(f'{signame}: the sweep stopped in point {name} (re-run the sweep to resume it); {left} '
      f'(exit {status})')
  raise preempt.Stopped(signame, rows=rows, csv=csv)
