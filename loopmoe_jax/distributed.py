"""Starting a multi-process run: which launcher started this process, and jax.distributed.

`--distributed=auto` (every script that builds a model) joins a multi-process run when one of
these started the process, and runs alone otherwise:

| launcher | detected by | processes |
|---|---|---|
| explicit | `--coordinator_address` (or JAX_COORDINATOR_ADDRESS) | `--num_processes` |
| SLURM (`srun`) | SLURM_JOB_ID, SLURM_NTASKS, SLURM_PROCID | SLURM_NTASKS |
| Open MPI (`mpirun`) | OMPI_MCA_orte_hnp_uri / OMPI_COMM_WORLD_SIZE | OMPI_COMM_WORLD_SIZE |
| Cloud TPU VM | a Google TPU on the PCI bus (vendor 0x1ae0) | the VM's workers (jax asks the metadata server; one on a single-host VM) |
| Kubernetes (GKE TPU) | TPU_WORKER_HOSTNAMES | its host names |

`--distributed=on` requires one (an error otherwise); `off` runs alone whatever launched it.
jax.distributed.initialize then finds the coordinator, the process count and this process's
index from the same environment. A process whose peers never come (a run started on some
hosts only) stops after `timeout_s` with one line naming the coordinator and the counts.

A process of the run that dies later (killed, its host lost): where a collective of the
others fails on it (XLA:CPU's gloo: the peer closed its connection), the trainer raises
`PeerLost`, one line naming the run's last saved checkpoint, and the CLI exits at once
(status 1). Where the collective waits instead, the coordination service declares the process
lost after `heartbeat_timeout_s` without heartbeats and jaxlib ends the others with its own
fatal error (a C++ abort with every thread's stack): jax offers no hook for it (jaxlib's
client takes a `missed_heartbeat_callback`, but calling a Python one aborts with std::bad_cast
in jaxlib 0.10.2); --heartbeat_timeout shortens the wait.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import sys
import threading

from loopmoe_jax import storage

MODES = ('auto', 'on', 'off')
_GOOGLE_PCI_VENDOR = '0x1ae0'


@dataclasses.dataclass(frozen=True)
class Launch:
  """How this process was started: `launcher` ('explicit', 'slurm', 'openmpi', 'tpu_vm',
  'gke_tpu'), its process count (None: asked at start, a TPU VM's workers) and explicit
  arguments for jax.distributed.initialize."""
  launcher: str
  processes: int | None
  args: tuple = ()

  @property
  def several(self) -> bool:
    return self.processes is None or self.processes > 1


def _int(env, name):
  try:
    return int(env.get(name, ''))
  except ValueError:
    return None


def _has_tpu() -> bool:
  for vendor in glob.glob('/sys/bus/pci/devices/*/vendor'):
    try:
      if open(vendor).read().strip() == _GOOGLE_PCI_VENDOR:
        return True
    except OSError:
      continue
  return False


def detect(coordinator_address=None, num_processes=None, process_id=None,
           env=None, has_tpu=_has_tpu) -> Launch | None:
  """The launcher of this process (module docstring's table), or None: a process alone."""
  env = os.environ if env is None else env
  if coordinator_address:
    return Launch('explicit', num_processes, (('coordinator_address', coordinator_address),
                                              ('num_processes', num_processes),
                                              ('process_id', process_id)))
  if 'SLURM_JOB_ID' in env and _int(env, 'SLURM_NTASKS') is not None and 'SLURM_PROCID' in env:
    return Launch('slurm', _int(env, 'SLURM_NTASKS'))
  if 'OMPI_COMM_WORLD_SIZE' in env or 'OMPI_MCA_orte_hnp_uri' in env:
    return Launch('openmpi', _int(env, 'OMPI_COMM_WORLD_SIZE'))
  hosts = env.get('TPU_WORKER_HOSTNAMES', '')
  if hosts and has_tpu():
    return Launch('gke_tpu', len(hosts.split(',')))
  if has_tpu():
    return Launch('tpu_vm', None)
  return None


def initialize(mode: str = 'auto', coordinator_address=None, num_processes=None,
               process_id=None, timeout_s: int = 300,
               heartbeat_timeout_s: int = 100) -> Launch | None:
  """Joins the multi-process run this process belongs to (before any other JAX call); the
  Launch joined, or None when running alone."""
  if mode not in MODES:
    raise ValueError(f'--distributed={mode}: must be one of {", ".join(MODES)}')
  if mode == 'off':
    if coordinator_address:
      raise ValueError(f'--distributed=off with --coordinator_address={coordinator_address}: '
                       'drop one of them')
    return None
  launch = detect(coordinator_address, num_processes, process_id)
  if launch and launch.launcher == 'explicit':
    missing = [k for k, v in launch.args if v is None]
    if missing:
      raise ValueError(f'--coordinator_address={coordinator_address} needs '
                       f'{" and ".join("--" + k for k in missing)} (or JAX_NUM_PROCESSES / '
                       'JAX_PROCESS_ID)')
  if launch is None or not launch.several:
    if mode == 'on':
      raise ValueError('--distributed=on: no multi-process launcher found (SLURM, Open MPI, a '
                       'Cloud TPU VM, or --coordinator_address); use --distributed=auto to run '
                       'alone')
    return None
  import jax  # pylint: disable=import-outside-toplevel
  where = coordinator_address or os.environ.get('JAX_COORDINATOR_ADDRESS') or 'the coordinator'
  me = '?' if process_id is None else process_id
  message = (f'distributed start ({launch.launcher}): process {me} of '
             f'{launch.processes or "?"} waited {timeout_s} s at {where} and not every process '
             'came; start the same command on every host')
  # JAX aborts the process (a C++ fatal error, thousands of characters) when its own timeout
  # passes: this one fires first, with one line
  watchdog = threading.Timer(timeout_s, _give_up, (message,))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(**dict(launch.args), initialization_timeout=timeout_s + 60,
                               heartbeat_timeout_seconds=heartbeat_timeout_s)
  except Exception as e:  # pylint: disable=broad-except
    text = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    raise RuntimeError(f'{message} ({text})') from None
  finally:
    watchdog.cancel()
  return launch


# What a collective says when a process of the run is gone (XLA:CPU's gloo, NCCL, the
# coordination service)
LOST_PEER = ('Connection closed by peer', 'Connection reset by peer', 'heartbeat timeout',
             'remote process exited', 'stopped sending heartbeats')


class PeerLost(RuntimeError):
  """A process of the run is gone: the CLI prints this one line and exits at once (status 1)
  without jax's shutdown barrier, which would wait for the lost process and abort."""


def lost_peer(error: BaseException) -> bool:
  """Whether `error` (raised by a step of a multi-process run) says a peer is gone."""
  return any(mark in str(error) for mark in LOST_PEER)


def lost_message(error: BaseException, workdir: str | None) -> str:
  """One line: the run lost a process (the first line of the collective's error), the last
  checkpoint saved in `workdir`, and how to go on."""
  first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
  return (f'the run lost a process ({first}); {last_saved(workdir)}; start the same command '
          'on every host to resume')


def last_saved(workdir: str | None) -> str:
  """'the last saved checkpoint is step N in DIR' (or that none is) for a run directory."""
  if not workdir:
    return 'no run directory'
  directory = storage.join(workdir, 'checkpoints')
  try:
    steps = [int(n) for n in storage.listdir(directory) if n.isdigit()]
  except (OSError, ValueError):
    steps = []
  if not steps:
    return f'no checkpoint was saved in {directory}'
  return f'the last saved checkpoint is step {max(steps)} in {directory}'


def _give_up(message: str):
  print(f'error: {message}', file=sys.stderr, flush=True)
  os._exit(1)  # pylint: disable=protected-access  (the main thread is blocked in JAX)
