"""Shared pieces of the thin CLIs: the --config flag and a runner with clear errors."""
from __future__ import annotations

import difflib
import os
import sys

from absl import app
from ml_collections import config_flags

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              'configs', 'default.py')


def config_flag(default: str = DEFAULT_CONFIG):
  """Defines --config (a file[:arg]); a --config.X override naming no field exits with the
  near names."""
  try:
    _check_overrides(sys.argv[1:], default)
  except SystemExit:
    raise
  except Exception:  # a broken config file: absl reports it when it loads the file
    pass
  return config_flags.DEFINE_config_file('config', default, 'Config file[:arg].')


def _check_overrides(argv, default):
  """Names near keys for a --config.X.Y=... that does not exist (before absl parses it)."""
  overrides = [a[2:].split('=')[0] for a in argv if a.startswith('--config.')]
  if not overrides:
    return
  path = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), default)
  cfg = config_flags.config_flags.ConfigFileFlagParser('config').parse(path)
  for key in overrides:
    node, parts = cfg, key.split('.')[1:]
    for i, part in enumerate(parts):
      if not hasattr(node, 'keys') or part not in node.keys():
        where = '.'.join(parts[:i]) or '(top)'
        known = list(node.keys()) if hasattr(node, 'keys') else []
        near = difflib.get_close_matches(part, known, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(near)}?" if near else f'; known: {sorted(known)}'
        sys.exit(f'error: --{key}: {where} has no field {part!r}{hint}')
      node = node[part]


def distributed_flags():
  """--coordinator_address/--num_processes/--process_id (default: the environment variables
  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) and --distributed (let JAX
  detect the cluster: TPU pods, SLURM, Open MPI, Kubernetes)."""
  from absl import flags
  env = os.environ.get
  return {
      'coordinator_address': flags.DEFINE_string(
          'coordinator_address', env('JAX_COORDINATOR_ADDRESS'),
          'host:port of process 0 for a multi-process run.'),
      'num_processes': flags.DEFINE_integer(
          'num_processes', int(env('JAX_NUM_PROCESSES', 0)) or None, 'Processes in the run.'),
      'process_id': flags.DEFINE_integer(
          'process_id', int(env('JAX_PROCESS_ID', -1)) if env('JAX_PROCESS_ID') else None,
          'This process\'s index.'),
      'distributed': flags.DEFINE_bool(
          'distributed', False, 'Initialise jax.distributed from the cluster environment.'),
  }


def initialize_distributed(holders) -> None:
  """jax.distributed.initialize from the distributed_flags (before any other JAX call)."""
  import jax
  values = {k: h.value for k, h in holders.items()}
  if values.pop('distributed') or values['coordinator_address']:
    missing = [k for k, v in values.items() if v is None]
    if values['coordinator_address'] and missing:
      raise ValueError(f'--coordinator_address={values["coordinator_address"]} needs '
                       f'{" and ".join("--" + k for k in missing)} (or JAX_NUM_PROCESSES / '
                       'JAX_PROCESS_ID)')
    jax.distributed.initialize(**{k: v for k, v in values.items() if v is not None})


def run(main):
  """app.run with library INFO logs (Orbax, Grain) silenced; progress is printed."""
  from absl import logging
  def quiet_main(argv):
    logging.set_verbosity(logging.WARNING)
    return main(argv)
  app.run(quiet_main)
