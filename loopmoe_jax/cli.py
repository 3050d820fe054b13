"""Shared pieces of the thin CLIs: the --config flag and a runner with clear errors."""
from __future__ import annotations

import difflib
import logging
import os
import signal
import sys
import threading

from absl import app
from ml_collections import config_flags

from loopmoe_jax import DEFAULT_CONFIG, cli_usage, distributed, storage
from loopmoe_jax.config import RUN_FIELDS
from loopmoe_jax.experiment import load_config


def debug() -> bool:
  """Tracebacks on: --debug on the command line or LOOPMOE_DEBUG=1."""
  return '--debug' in sys.argv[1:] or os.environ.get('LOOPMOE_DEBUG', '') not in ('', '0')


def fail(message: str):
  """Exits with `error: message` on stderr (status 1)."""
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(1)


def pass_counts(values) -> list:
  """A --num_loops list as ints ([None]: the trained count when empty), or a ValueError
  naming the flag."""
  try:
    return [int(n) for n in values] or [None]
  except ValueError:
    raise ValueError(f'--num_loops={",".join(values)}: pass counts must be integers') from None


def check_output_dir(flag: str, path: str) -> None:
  """Before any work: a ValueError naming the flag when `path` cannot become an output
  directory (an existing file there or above it); a missing directory is made later."""
  if not path or storage.is_url(path):  # a URL is written through storage.py
    return
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f'{flag}={path} is a file: expected a directory (made when missing)')
  above = os.path.dirname(os.path.abspath(path))
  while not os.path.exists(above):
    above = os.path.dirname(above)
  if not os.path.isdir(above):
    raise ValueError(f'{flag}={path}: {above} is a file, so no directory can be made there')


def check_output_file(flag: str, path: str) -> None:
  """Before any work: a ValueError naming the flag when `path` cannot be written as a file
  (it is a directory, or its directory does not exist)."""
  if not path or storage.is_url(path):  # a URL is written through storage.py
    return
  if os.path.isdir(path):
    raise ValueError(f'{flag}={path} is a directory: expected a file name')
  parent = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(parent):
    what = 'is a file' if os.path.exists(parent) else 'does not exist'
    raise ValueError(f'{flag}={path}: its directory {parent} {what}')


INTERRUPTED = 130  # the shell's status for a command stopped by SIGINT
_EXITING = threading.Lock()  # one exit line, whichever thread gets there first


def interrupted(again: bool = False):
  """Exits with one line and status 130: a Ctrl-C the training loop did not catch (during
  imports, set-up or compilation; the loop itself saves and stops, preempt.StopSignals), or
  a second one (`again`) while a stopped run saves."""
  if not _EXITING.acquire(blocking=False):  # another thread is printing and exiting
    threading.Event().wait()
  what = (' again: stopped without waiting for the save (a training run resumes from its last '
          'complete checkpoint)' if again else
          ': stopped (a training run resumes from its last checkpoint)')
  os.write(2, f'interrupted (SIGINT){what}\n'.encode())  # no lock another thread may hold
  os._exit(INTERRUPTED)  # pylint: disable=protected-access  (no interpreter teardown noise)


def _interrupt_hook(previous):
  def hook(exc_type, exc, tb):
    if issubclass(exc_type, KeyboardInterrupt) and not debug():
      interrupted()
    previous(exc_type, exc, tb)
  return hook


def _on_sigint(signum, frame):
  del signum, frame
  if debug():
    raise KeyboardInterrupt
  interrupted()


def _watch_interrupts(read_fd: int):
  """A thread's loop over the signals Python caught (signal.set_wakeup_fd's bytes, written
  the moment each arrives). The main thread runs a signal's Python handler only between
  bytecodes, so not while it compiles or waits in native code: this thread exits for it.
  While the SIGINT handler is `_on_sigint` a SIGINT exits at once; while another handler
  holds it (the training loop's save-and-stop) the first signal is that handler's and a
  SIGINT after it exits at once."""
  caught, holder = 0, None
  while True:
    try:
      data = os.read(read_fd, 64)
    except OSError:
      return
    for signum in data:
      if signum not in (signal.SIGINT, signal.SIGTERM):
        continue
      handler = signal.getsignal(signal.SIGINT)
      if handler is not holder:
        caught, holder = 0, handler
      caught += 1
      if signum == signal.SIGINT and handler is _on_sigint:
        interrupted()
      if signum == signal.SIGINT and caught > 1:
        interrupted(again=True)


def exit_on_interrupt() -> None:
  """A Ctrl-C before the training loop installs its own handler (preempt.StopSignals: save and
  stop, from its first step's dispatch) exits at once with one line and status 130: while
  modules import (jax takes seconds; an import may swallow a KeyboardInterrupt), while the
  run is set up and while its first program compiles (a thread acts on it, `_watch_interrupts`,
  as the main thread is busy in native code). A second Ctrl-C while a stopped run saves exits
  at once too. A script's entry (`run`) installs it; importing this module changes nothing."""
  sys.excepthook = _interrupt_hook(sys.excepthook)
  if threading.current_thread() is not threading.main_thread():
    return
  signal.signal(signal.SIGINT, _on_sigint)
  if debug():  # the traceback of where it was, once the main thread gets there
    return
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  old = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  if old != -1:  # one is in place already (installed before, or someone else's): keep it
    signal.set_wakeup_fd(old)
    os.close(read_fd)
    os.close(write_fd)
    return
  threading.Thread(target=_watch_interrupts, args=(read_fd,), daemon=True,
                   name='interrupts').start()


def config_flag(default: str = DEFAULT_CONFIG):
  """Defines --config (a file[:arg]). A config file that does not load, or a --config.X
  override naming no field (with the near names), exits with one line before absl parses."""
  try:
    _check_config(sys.argv[1:], default)
  except SystemExit:
    raise
  except Exception as e:  # pylint: disable=broad-except
    if debug():
      raise
    path = next((a.split('=', 1)[1] for a in sys.argv[1:] if a.startswith('--config=')),
                default)
    root = e.__cause__ or e
    text = str(root)
    if 'Traceback' in text:  # ml_collections wraps the config file's error with its traceback
      text = [l for l in text.splitlines() if l.strip()][-1]
    fail(f'--config={path}: {text}' if isinstance(root, ValueError)
         else f'--config={path}: {type(root).__name__}: {text}')
  return config_flags.DEFINE_config_file('config', default, 'Config file[:arg].')


def _check_config(argv, default):
  """Loads the config file (its errors surface here, once) and names near keys for a
  --config.X.Y=... that does not exist."""
  path = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), default)
  cfg = load_config(path)
  overrides = [a[2:].split('=')[0] for a in argv if a.startswith('--config.')]
  for key in overrides:
    node, parts = cfg, key.split('.')[1:]
    for i, part in enumerate(parts):
      if not hasattr(node, 'keys') or part not in node.keys():
        where = '.'.join(parts[:i]) or '(top)'
        known = list(node.keys()) if hasattr(node, 'keys') else []
        near = difflib.get_close_matches(part, known, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(near)}?" if near else f'; known: {sorted(known)}'
        if where == 'model' and part in RUN_FIELDS and 'run' in cfg.keys():
          hint = f' (a run setting now): use --config.run.{part}'
        sys.exit(f'error: --{key}: {where} has no field {part!r}{hint}')
      node = node[part]


def distributed_flags():
  """--distributed=auto|on|off (loopmoe_jax/distributed.py: auto joins a multi-process run
  when SLURM, Open MPI, a Cloud TPU VM or --coordinator_address started this process),
  --coordinator_address/--num_processes/--process_id (default: the environment variables
  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) and --distributed_timeout."""
  from absl import flags
  env = os.environ.get

  def env_int(name):
    value = env(name)
    if value is None or value == '':
      return None
    try:
      return int(value)
    except ValueError:
      fail(f'environment variable {name}={value!r}: expected an integer')
  return {
      'coordinator_address': flags.DEFINE_string(
          'coordinator_address', env('JAX_COORDINATOR_ADDRESS'),
          'host:port of process 0 for a multi-process run.'),
      'num_processes': flags.DEFINE_integer(
          'num_processes', env_int('JAX_NUM_PROCESSES'), 'Processes in the run.'),
      'process_id': flags.DEFINE_integer(
          'process_id', env_int('JAX_PROCESS_ID'), 'This process\'s index.'),
      'mode': flags.DEFINE_enum(
          'distributed', 'auto', ['auto', 'on', 'off'],
          'Join a multi-process run: auto (when a launcher is detected: SLURM, Open MPI, a '
          'Cloud TPU VM, --coordinator_address), on (required), off (run alone).'),
      'timeout_s': flags.DEFINE_integer(
          'distributed_timeout', 300, 'Seconds to wait for every process of the run.'),
      'heartbeat_timeout_s': flags.DEFINE_integer(
          'heartbeat_timeout', 100, 'Seconds without heartbeats after which a process of the '
          'run counts as lost: the others then stop with one line naming it.'),
  }


def search_flags():
  """--target, --search (repeatable) and --compiler_preset: the flags of the scripts that
  search run settings by real compiles for a target (fit.py, plan.py)."""
  from absl import flags
  return {'target': flags.DEFINE_string('target', None, 'The accelerator target '
                                        '(loopmoe_jax/targets.py).'),
          'search': flags.DEFINE_multi_string(
              'search', [], 'KEY=V1,V2: values to search for a key (repeatable); default '
              'run.remat, train.microbatches, run.loss_chunk (loopmoe_jax/fit.py SEARCH).'),
          'preset': flags.DEFINE_string('compiler_preset', 'pod', 'pod | none '
                                        '(loopmoe_jax/aot.py).')}


def main_process() -> bool:
  """Process 0 of the run (the one that prints results and writes files), or a process alone."""
  import jax
  return jax.process_index() == 0


def initialize_distributed(holders) -> None:
  """Joins the multi-process run (distributed.initialize) before any other JAX call, and says
  so in one line per process."""
  launch = distributed.initialize(**{k: h.value for k, h in holders.items()})
  if launch is not None:
    import jax
    print(f'process {jax.process_index()} of {jax.process_count()} ({launch.launcher}): '
          f'{jax.local_device_count()} of {jax.device_count()} devices', flush=True)


class _Prefixed(logging.Formatter):
  """`WARNING: message` for a warning (ERROR: ... above it), `note: message` for an INFO note."""

  def __init__(self):
    super().__init__('%(prefix)s: %(message)s')

  def format(self, record):
    record.prefix = 'note' if record.levelno == logging.INFO else record.levelname
    return super().format(record)


class _Stderr(logging.StreamHandler):
  """A handler writing to the sys.stderr of the moment (as logging's last resort does)."""

  def __init__(self):
    logging.Handler.__init__(self, logging.INFO)  # pylint: disable=non-parent-init-called
    self.setFormatter(_Prefixed())

  @property
  def stream(self):
    return sys.stderr


def log_to_stderr() -> None:
  """The library's warnings and notes (the 'loopmoe_jax' logger: a stale lock, a checkpoint
  skipped or unverified, ...) on stderr as `WARNING: ...` and `note: ...` lines, INFO and
  above, not passed on to the root logger (absl's handler there would print them again).
  Once per process; a script's entry (`run`) calls it, importing this module does not (a
  library user gets Python's default: warnings on stderr, notes dropped)."""
  logger = logging.getLogger('loopmoe_jax')
  if not logs_to_stderr():
    logger.addHandler(_Stderr())
  logger.setLevel(logging.INFO)
  logger.propagate = False


def logs_to_stderr() -> bool:
  """`log_to_stderr` was called in this process (a sweep's child process then calls it too)."""
  return any(isinstance(h, _Stderr) for h in logging.getLogger('loopmoe_jax').handlers)


class _QuietOrbax:
  """Drops Orbax's notes that a read-only manager is read-only (evaluate, generate), and the
  tracebacks its writer threads log for a failed save (the trainer reports that failure in
  one line, checkpoint.CheckpointSaveError)."""

  def filter(self, record):
    text = record.getMessage()
    if 'read only' in text or 'read_only=True' in text or 'Skipping merge of OCDBT' in text:
      return False
    from_orbax = '/orbax/' in record.pathname or 'orbax' in text
    return not (from_orbax and record.levelno >= logging.ERROR)


def run(main):
  """app.run with library INFO logs (Orbax, Grain) silenced, progress printed, this package's
  warnings and notes as `WARNING: ...` and `note: ...` lines on stderr (`log_to_stderr`), and
  an error printed as one line `error: ...` (exit status 1); --debug or LOOPMOE_DEBUG=1 shows
  the traceback instead. A script's process gets the interrupt exit (`exit_on_interrupt`), the
  log handler and the quiet Orbax hooks (`checkpoint.quiet_orbax_errors`) here, not on import."""
  exit_on_interrupt()
  log_to_stderr()
  from absl import flags, logging as absl_logging
  flags.DEFINE_bool('debug', False, 'Show tracebacks of errors.')
  cli_usage.show_cli_flags(flags.FLAGS)  # --help lists --config, --debug, ... beside its own
  cli_usage.render_usage()  # the docstring's `\` line continuations as written

  def quiet_main(argv):
    # imported here: Orbax and jax load after the interrupt handler is in place
    from loopmoe_jax.train.checkpoint import quiet_orbax_errors  # pylint: disable=import-outside-toplevel
    quiet_orbax_errors()
    absl_logging.set_verbosity(absl_logging.WARNING)
    for logger in (absl_logging.get_absl_logger(), logging.getLogger('asyncio')):
      logger.addFilter(_QuietOrbax())
    try:
      result = main(argv)
      # the work is done (a stopped run has saved on every process): a SIGTERM that reaches
      # this process late, while it exits, no longer changes anything
      if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
      return result
    except KeyboardInterrupt:
      if debug():
        raise
      interrupted()
    except Exception as e:  # pylint: disable=broad-except
      if debug():
        raise
      if type(e).__name__ == 'PeerLost':  # jax's shutdown barrier would wait for it, then abort
        print(f'error: {e}', file=sys.stderr, flush=True)
        os._exit(1)  # pylint: disable=protected-access
      plain = isinstance(e, (ValueError, RuntimeError, OSError)) and str(e)
      fail(str(e) if plain else f'{type(e).__name__}: {e}')
  def parse(argv):  # a flag value of the wrong type: one line, not absl's "FATAL ..." two
    try:
      return flags.FLAGS(argv)
    except flags.UnrecognizedFlagError as e:  # a usage error: status 2, the near names
      print(f'error: {cli_usage.unknown_flag_line(e.flagname, flags.FLAGS)}', file=sys.stderr,
            flush=True)
      sys.exit(2)
    except flags.Error as e:
      fail(f'{e} (see --helpshort)')

  app.run(quiet_main, flags_parser=parse)
