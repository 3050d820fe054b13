"""Metric writers: a progress line, JSONL, TensorBoard event files and, with train.wandb, a
Weights & Biases run (its mode from W&B's own WANDB_MODE: `offline` writes it locally for
`wandb sync`; the run id is the workdir's, so a resumed run continues the same W&B run)."""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import sys
import time

from loopmoe_jax import storage

log = logging.getLogger(__name__)


# The files a run writes beside its checkpoints (train/run.py's RunDir reads them back).
METRICS, ROUTING, SUMMARY = 'metrics.jsonl', 'routing.jsonl', 'summary.json'
FINAL_STEPS = 'final_steps.jsonl'  # the LM loss of every step of the final window


_NOTED: set[tuple[str, int]] = set()  # (file, line) of the torn lines noted in this process


def read_rows(path: str) -> list[dict]:
  """The JSON objects of a JSON-lines log (metrics.jsonl, routing.jsonl, final_steps.jsonl)
  in order, for a reader that must not stop at what a crash leaves: a last line cut short
  (the trainer killed mid-write; it moves such a line aside itself on resume) is skipped with
  a note naming the file and line. A line that does not parse anywhere else is damage, not a
  torn write: a ValueError naming the file and the line number."""
  numbered = [(n, line) for n, line in enumerate(storage.read_text(path).splitlines(), 1)
              if line.strip()]
  rows = []
  for i, (number, line) in enumerate(numbered):
    try:
      row = json.loads(line)
      if not isinstance(row, dict):
        raise ValueError(f'a JSON {type(row).__name__}, not an object')
    except ValueError as e:
      if i < len(numbered) - 1:
        raise ValueError(f'{path}: line {number} is not a JSON row ({e}): the file is damaged '
                         'there') from None
      if (path, number) not in _NOTED:
        _NOTED.add((path, number))
        logging.getLogger(__name__).info(
            f'{path}: line {number} is not a whole row (a write cut short); skipped')
      break
    rows.append(row)
  return rows


def final_window(steps: int, warmup: int, window: int) -> tuple[int, str | None]:
  """How many of a run's last steps its final-window loss averages (summary.json's
  final_window_loss, a sweep's `loss`), and a note when that is not train.final_window: a
  window longer than the steps after train.warmup is shrunk to those steps (a short run
  would otherwise summarise its warmup), or to the last half of the run when it ends inside
  its warmup. The note is None when the window is train.final_window."""
  after = steps - warmup
  if window <= after:
    return window, None
  plural = lambda n: f'{n} step{"s" * (n != 1)}'  # noqa: E731
  if after >= 1:
    return after, (f'train.final_window={window} is longer than the {plural(after)} after '
                   f'train.warmup={warmup} in this {steps}-step run: the final-window loss '
                   + ('averages that step' if after == 1 else f'averages those {plural(after)}'))
  n = max(1, steps // 2)
  return n, (f'this {steps}-step run ends inside train.warmup={warmup}: the final-window loss '
             f'averages its last half ({plural(n)}), not train.final_window={window}')


def append_lines(path: str, lines: list[str]):
  """Appends whole lines to `path` in one write: a write cut short (a full disk) is undone, so
  the file never ends in a partial line, and the error names the file. On object storage the
  object is written again whole (an upload is atomic)."""
  data = ''.join(line + '\n' for line in lines).encode()
  if storage.is_url(path):
    old = storage.read_bytes(path) if storage.exists(path) else b''
    storage.write_bytes(path, old + data)
    return
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    size = os.fstat(fd).st_size
    try:
      written = os.write(fd, data)
      if written != len(data):
        raise OSError(errno.ENOSPC, 'No space left on device (the write was cut short)')
    except OSError as e:
      try:
        os.ftruncate(fd, size)  # the file as it was: no torn line
      except OSError:
        pass
      fix = ('free space' if e.errno in (errno.ENOSPC, errno.EDQUOT) else
             'make it writable')
      raise OSError(e.errno, f'writing {path} failed: {e.strerror}; the checkpoints are '
                    f'intact: {fix} and rerun the same command to resume') from None
  finally:
    os.close(fd)


class Writer:
  def __init__(self, workdir: str, total_steps: int, tensorboard: bool = True, enabled=True,
               resume_step: int = 0, wandb_project: str = '', config: dict | None = None):
    self.enabled, self.total = enabled, total_steps
    self.t0 = time.time()
    self._jsonl = self._tb = self._wandb = None
    if enabled:
      storage.makedirs(workdir)
      path = storage.join(workdir, METRICS)
      for name in (METRICS, ROUTING, FINAL_STEPS):  # rows past the restored step go
        _drop_rows_after(storage.join(workdir, name), resume_step)
      self._jsonl = path
      self._final = storage.join(workdir, FINAL_STEPS)
      if tensorboard:  # (tensorboardX writes gs:// itself, through google-cloud-storage)
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(storage.join(workdir, 'tb'))
      if wandb_project:
        self._wandb = _wandb_run(wandb_project, workdir, config, resume_step)

  def write(self, step: int, scalars: dict, prefix: str = ''):
    if not self.enabled:
      return
    row = {'step': step, **{prefix + k: float(v) for k, v in scalars.items()}}
    append_lines(self._jsonl, [json.dumps(row)])
    if self._tb is not None:
      for k, v in row.items():
        if k != 'step':
          self._tb.add_scalar(k, v, step)
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in row.items() if k != 'step'}, step=step)

  def record_step(self, step: int, loss: float):
    """One row of final_steps.jsonl (the trainer calls it for every step of the final
    window, logged or not)."""
    if self.enabled:
      append_lines(self._final, [json.dumps({'step': step, 'loss': float(loss)})])

  def progress(self, step: int, m: dict):
    if not self.enabled:
      return
    frac = step / self.total
    bar = '#' * int(20 * frac) + '.' * (20 - int(20 * frac))
    parts = [f'[{bar}] step {step}/{self.total}', f"loss {m['loss']:.4f}"]
    for key, fmt in (('val_loss', '{:.4f}'), ('tokens_per_s', '{:,.0f} tok/s'),
                     ('mfu', '{:.1%} MFU'), ('lr', 'lr {:.2e}')):
      if key in m:
        parts.append((key.split('_')[0] + ' ' if key == 'val_loss' else '') + fmt.format(m[key]))
    for key in sorted(k for k in m if k.startswith('max_vio_')):  # with model.router_bias
      parts.append(f"maxvio {key[len('max_vio_'):]} {m[key]:.2f}")
    if m.get('dropped'):
      parts.append(f"dropped {m['dropped']:,.0f}")
    if m.get('replayed'):
      parts.append(f"replayed {m['replayed']:,.0f}")
    print('  '.join(parts), file=sys.stdout, flush=True)

  def close(self):
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.finish()


def _wandb_run(project: str, workdir: str, config: dict | None, resume_step: int):
  """The W&B run of `workdir` (train.wandb = the project): its id a hash of the workdir, its
  local files in WORKDIR/wandb (W&B's WANDB_DIR, or its default, for a gs:// workdir)."""
  try:
    import wandb  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ValueError(f'train.wandb={project!r} needs the wandb package: pip install wandb') from None
  run_id = hashlib.sha256(storage.absolute(workdir).encode()).hexdigest()[:16]
  kw = {} if storage.is_url(workdir) or os.environ.get('WANDB_DIR') else {
      'dir': storage.join(workdir)}
  return wandb.init(project=project, id=run_id, resume='allow', config=config,
                    name=os.path.basename(storage.absolute(workdir).rstrip('/')),
                    settings=wandb.Settings(quiet=True, console='off'), **kw)


def _drop_rows_after(path: str, step: int):
  """On resume, forgets rows logged after the restored step (they will be logged again). A
  line that does not parse as a row (a write torn by a full disk or a kill) does not block the
  resume: it is moved to PATH.torn, nothing lost, with a warning naming the file and line."""
  if not storage.exists(path):
    return
  rows, torn = [], []
  for number, line in enumerate(storage.read_text(path).splitlines(keepends=True), 1):
    if not line.strip():
      continue
    try:
      row_step = json.loads(line)['step']
    except (ValueError, KeyError, TypeError):
      torn.append((number, line if line.endswith('\n') else line + '\n'))
      continue
    if row_step <= step:
      rows.append(line if line.endswith('\n') else line + '\n')
  if torn:
    append_lines(path + '.torn', [line.rstrip('\n') for _, line in torn])
    log.warning(f'{path}: line {", ".join(str(n) for n, _ in torn)} is not a whole row (a '
                f'write cut short); moved to {path}.torn')
  storage.write_text(path, ''.join(rows))
