"""Orbax checkpoints: train state, data-iterator state and the resolved config per step.

Saves are asynchronous with keep-N and Orbax's atomic commit (a step directory appears
only once it is complete); a save that Orbax skips is an error. Restore takes the latest
step that reads back; a corrupt or partial step is reported and skipped for the previous
good one (the trainer then moves it aside, `set_aside`, so the run can write it again).
Reading a run's checkpoint without the trainer (evaluation, generation, export) is
`train/run.py`'s (`RunDir.load`).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import sys
import traceback

import jax
import numpy as np
import orbax.checkpoint as ocp

from loopmoe_jax import storage
from loopmoe_jax.train.checksums import CHECKSUMS, checksum_mismatch, checksums


log = logging.getLogger(__name__)


def _closed_loop(exc) -> bool:
  return isinstance(exc, RuntimeError) and str(exc) == 'Event loop is closed'


def _quiet_abandoned_reads(previous):
  """sys.unraisablehook that drops the errors of Orbax's abandoned work: restoring a damaged
  step fails on its first bad array and leaves the other reads' coroutines to fail unawaited,
  each printing a traceback with the whole TensorStore spec (thousands of lines), and
  TensorStore callbacks that finish after Orbax gave up call into a closed asyncio loop. The
  failed restore or save already names the step and path in one line; other errors pass."""
  def hook(unraisable):
    code = getattr(unraisable.object, 'cr_code', None)
    if code is not None and _orbax_file(code.co_filename):
      return
    # the same reads wrapped by asyncio (tasks._wrap_awaitable), Orbax's or TensorStore's own
    if _abandoned_read(unraisable.exc_value, unraisable.exc_traceback):
      return
    if _closed_loop(unraisable.exc_value):
      return
    previous(unraisable)
  return hook


def _orbax_file(path: str) -> bool:
  return f'{os.sep}orbax{os.sep}' in path


def _abandoned_read(exc, tb) -> bool:
  """`exc` (with traceback `tb`) is the error of one of Orbax's abandoned reads: raised in
  Orbax's code, or a TensorStore read's error (a future that asyncio wraps: its traceback is
  asyncio's alone, its message names the TensorStore driver)."""
  frames = traceback.extract_tb(tb) if tb else []
  if any(_orbax_file(f.filename) for f in frames):
    return True
  asyncio_only = bool(frames) and all(f'{os.sep}asyncio{os.sep}' in f.filename for f in frames)
  return asyncio_only and isinstance(exc, ValueError) and '" driver' in str(exc)


def _quiet_closed_loop(previous):
  """sys.excepthook dropping the closed-loop errors above (raised in callbacks' threads)."""
  def hook(kind, value, tb):
    if not _closed_loop(value):
      previous(kind, value, tb)
  return hook


class _AbandonedOrbaxTasks(logging.Filter):
  """asyncio's 'Task exception was never retrieved' for Orbax's abandoned reads (above)."""

  def filter(self, record):
    if record.levelno < logging.ERROR or 'never retrieved' not in record.getMessage():
      return True
    exc, tb = (record.exc_info[1], record.exc_info[2]) if record.exc_info else (None, None)
    return not _abandoned_read(exc, tb)


_QUIETED = []  # set once the hooks below are installed in this process


def quiet_orbax_errors() -> None:
  """Installs, once per process, the hooks above: sys.unraisablehook and sys.excepthook drop
  Orbax's abandoned-read and closed-loop errors, and asyncio's logger its never-retrieved
  task errors (every other error passes). Called by the scripts' entry (cli.run) and by the
  trainer; importing this module changes nothing."""
  if _QUIETED:
    return
  sys.unraisablehook = _quiet_abandoned_reads(sys.unraisablehook)
  sys.excepthook = _quiet_closed_loop(sys.excepthook)
  logging.getLogger('asyncio').addFilter(_AbandonedOrbaxTasks())
  _QUIETED.append(True)


def manager(directory: str, keep: int = 3, async_save: bool = True, read_only: bool = False,
            keep_every: int = 0, keep_steps=()):
  """Keeps the newest `keep` steps, plus every multiple of `keep_every` and the `keep_steps`
  for good (a continuation's starting point survives `keep`)."""
  kept = dict(max_to_keep=keep)
  if keep_every or keep_steps:
    from orbax.checkpoint import checkpoint_managers as policies
    rules = [policies.LatestN(keep)]
    if keep_every:
      rules.append(policies.EveryNSteps(keep_every))
    if keep_steps:
      rules.append(policies.CustomSteps(list(keep_steps)))
    kept = dict(preservation_policy=policies.AnyPreservationPolicy(rules))
  opts = ocp.CheckpointManagerOptions(**kept, create=not read_only,
                                      enable_async_checkpointing=async_save, read_only=read_only)
  handlers = {'state': ocp.StandardCheckpointHandler(use_ocdbt=use_ocdbt(directory)),
              'data': ocp.JsonCheckpointHandler(),
              'config': ocp.JsonCheckpointHandler()}
  return ocp.CheckpointManager(storage.absolute(directory), options=opts,
                               item_handlers=handlers)


def use_ocdbt(directory: str) -> bool:
  """Orbax's OCDBT format (few large files), except on an object store that ignores write
  preconditions (storage.honours_preconditions: OCDBT's commits rely on them there), where
  each array is its own files (said once)."""
  if not storage.is_url(directory) or storage.honours_preconditions(directory):
    return True
  if directory not in _SAID:
    _SAID.add(directory)
    log.warning(f'the store of {directory} ignores write preconditions: checkpoints are written '
                'one file per array (no OCDBT)')
  return False


_SAID = set()


class CheckpointSaveError(RuntimeError):
  """A checkpoint could not be written (one line: step, directory, cause, free space)."""


def _remove_temporaries(directory: str):
  for name in storage.listdir(directory):
    if '.orbax-checkpoint-tmp' in name:
      storage.rmtree(storage.join(directory, name))


def _cause(e: BaseException) -> str:
  seen = e
  while seen is not None:
    if isinstance(seen, OSError) and seen.errno == errno.ENOSPC or 'No space left' in str(seen):
      return 'no space left on device'
    seen = seen.__cause__ or seen.__context__
  return f'{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ""}'


def save_error(e: BaseException, step: int, directory: str) -> CheckpointSaveError:
  """The one-line error for a failed save; removes the save's temporary directories."""
  _remove_temporaries(directory)
  free = storage.free_bytes(directory)
  where = '' if free is None else f'; {free / 2**20:.1f} MiB free there'
  return CheckpointSaveError(f'saving checkpoint step {step} to {directory} failed ({_cause(e)}'
                             f'{where}); earlier steps are kept')


def save(mngr, step: int, state, data_state, config_json: str, force: bool = False,
         checksum=None):
  """Saves a step (asynchronously when the manager is) with its checksums (`checksum`: the
  program to compute them, see `checksums`). Not enough free space for the state (its bytes
  plus 1 MiB), a failed write, or an earlier asynchronous save that failed raise
  CheckpointSaveError naming the step, the directory and the free space."""
  directory = str(mngr.directory)
  check_background(mngr, wait=True)  # the previous save (Orbax waits for it anyway)
  need = sum(x.nbytes for x in jax.tree.leaves(state)) + (1 << 20)
  free = storage.free_bytes(directory)  # None on object storage: no check there
  if free is None and ('free', directory) not in _SAID:
    _SAID.add(('free', directory))
    log.info(f'{directory} is object storage: free space is not checked before saving')
  if free is not None and free < need:
    raise CheckpointSaveError(
        f'checkpoint step {step} not saved: {directory} has {free / 2**20:.1f} MiB free, the '
        f'step needs about {need / 2**20:.1f} MiB; earlier steps are kept')
  data_state = dict(data_state or {}, **{CHECKSUMS: checksums(state, checksum)})
  try:
    saved = mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave(json.loads(config_json))), force=force)
  except Exception as e:  # pylint: disable=broad-except
    raise save_error(e, step, directory) from None
  if not saved:  # Orbax skips a step that already exists rather than overwrite it
    raise RuntimeError(f'checkpoint step {step} was not written in {mngr.directory} (a step '
                       f'{step} exists there already: {sorted(mngr.all_steps())})')
  mngr.pending_step = step


def check_background(mngr, wait: bool = False):
  """Raises CheckpointSaveError when the last asynchronous save failed (with `wait`, after it
  finished). Cheap: the trainer calls it every step, so a failed save stops the run within a
  step or two of the step it saved."""
  step = getattr(mngr, 'pending_step', None)
  if step is None:
    return
  if not wait and mngr.is_saving_in_progress():
    return
  mngr.pending_step = None
  try:  # finished: a failed background write raises here
    mngr.wait_until_finished()
    mngr.check_for_errors()
  except Exception as e:  # pylint: disable=broad-except
    raise save_error(e, step, str(mngr.directory)) from None
  if not storage.isdir(storage.join(str(mngr.directory), str(step))):
    # Orbax logs (and does not raise) a failure while it finalizes the step
    raise save_error(RuntimeError('the step was never finalized (see the log)'), step,
                     str(mngr.directory))


def stored_config(mngr):
  """(step, config dict) of the newest step whose config reads back, or None."""
  for s in sorted(mngr.all_steps(), reverse=True):
    try:
      return s, mngr.restore(s, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']
    except Exception:  # pylint: disable=broad-except  (a damaged step: try the previous one)
      continue
  return None


class StateMismatch(ValueError):
  """An intact checkpoint whose train state does not fit the one asked for."""


def spread(shape) -> jax.sharding.Sharding:
  """A sharding for a leaf of unknown role: its first dimension that divides over every device
  split over all of them (else replicated), so no device holds a whole large array."""
  devices = jax.devices()
  mesh = jax.sharding.Mesh(np.asarray(devices), ('all',))
  dims = [None] * len(shape)
  for i, n in enumerate(shape):
    if n % len(devices) == 0:
      dims[i] = 'all'
      break
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*dims))


def unreadable_part(mngr, step: int) -> str | None:
  """'PATH (error)' of the first part of the step (config, data-iterator state, train state)
  that does not read back as stored, or None when all do. The train state is restored spread
  over every device (`spread`), never whole on one."""
  base = storage.join(str(mngr.directory), str(step))
  for item in ('config', 'data'):
    try:
      mngr.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))
    except Exception as e:  # pylint: disable=broad-except
      return f'{storage.join(base, item)} ({type(e).__name__}: {str(e)[:120]})'
  try:
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype,
                                                         sharding=spread(m.shape)),
                          mngr.item_metadata(step)['state'])
    mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
  except Exception as e:  # pylint: disable=broad-except
    return f'{storage.join(base, "state")} ({type(e).__name__}: {str(e)[:120]})'
  return None


def _free_name(folder: str, name: str) -> str:
  """folder/name, or folder/name.1, .2, ... if taken (an earlier set-aside's: kept too)."""
  dst, n = storage.join(folder, name), 1
  while storage.exists(dst):
    dst, n = storage.join(folder, f'{name}.{n}'), n + 1
  return dst


def set_aside(mngr, steps, workdir: str, files=()) -> list[str]:
  """Moves the given (unreadable) step directories, and those of the workdir's `files` that
  exist, to workdir/unreadable_checkpoints/, so a resumed run can save those steps again and
  nothing is deleted; returns the steps' new paths. One process only: with several, every
  process would move the same files."""
  if jax.process_count() > 1:
    raise RuntimeError(f'checkpoint steps {list(steps)} in {mngr.directory} are unreadable; '
                       'move them out of the directory and restart')
  aside = storage.join(workdir, 'unreadable_checkpoints')
  storage.makedirs(aside)
  moved = []
  for s in steps:
    moved.append(_free_name(aside, str(s)))
    storage.rename(storage.join(str(mngr.directory), str(s)), moved[-1])
  for name in files:
    if storage.exists(storage.join(workdir, name)):
      storage.rename(storage.join(workdir, name), _free_name(aside, name))
  mngr.reload()
  return moved


def restore_latest(mngr, abstract_state, step: int | None = None, skipped=None):
  """(step, state, data_state, config dict) of the newest readable step, or None if none.

  With `step`, only that step is tried. Unreadable steps are logged, skipped and, when
  `skipped` is a dict, put in it with why ({step: reason}, newest first). A step that restores
  as stored but not into abstract_state (another optimizer, another model) raises
  StateMismatch."""
  steps = sorted(mngr.all_steps(), reverse=True) if step is None else [step]
  for s in steps:
    try:
      out = mngr.restore(s, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
          config=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises many kinds for a damaged step
      bad = unreadable_part(mngr, s)
      if bad is None:
        raise StateMismatch(f'checkpoint step {s} in {mngr.directory} is intact but its train '
                            f'state does not fit this run\'s ({type(e).__name__}: '
                            f'{str(e)[:300]})') from e
    else:
      bad = _verify(out, s, str(mngr.directory))  # bytes that decode to other values
    if bad is None:
      return s, out['state'], out['data'], out['config']
    log.warning(f'checkpoint step {s} is unreadable: {bad}; skipping it')
    if skipped is not None:
      skipped[s] = bad
  return None


_UNVERIFIED_SAID = set()


def _verify(out, step: int, directory: str) -> str | None:
  """'PATH (checksum of ARRAY differs)' when a restored state's checksums differ from those
  saved with it; None when they agree, or when the step has none (written before checksums:
  said once per directory)."""
  stored = (out.get('data') or {}).get(CHECKSUMS)
  if stored is None:
    if directory not in _UNVERIFIED_SAID:
      _UNVERIFIED_SAID.add(directory)
      log.warning(f'checkpoint step {step} in {directory} has no checksums (written before '
                  'they were recorded): restored unverified')
    return None
  bad = checksum_mismatch(out['state'], stored)
  if bad is None:
    return None
  return (f'{storage.join(directory, str(step), "state")} (the checksum of {bad} differs from '
          'the one saved with it: the file is damaged)')
