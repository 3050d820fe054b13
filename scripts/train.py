"""Trains a looped MoE.

    python scripts/train.py --workdir=/tmp/run                          # configs/default.py
    python scripts/train.py --config=configs/foil.py:foil2,smoke --config.train.steps=200 \
        --workdir=/tmp/foil2
    python scripts/train.py --config.mesh.data=2 --config.mesh.expert=4 ...   # a device mesh
    python scripts/train.py --coordinator_address=HOST:PORT --num_processes=2 --process_id=0 ...

On CPU, JAX_NUM_CPU_DEVICES=N gives N fake devices.

Exit status: 0 when the run reached train.steps (or had already); 130 (SIGINT, Ctrl-C) or 143
(SIGTERM) when a signal stopped it after it saved its step, on every process of a
multi-process run ("SIGINT: saved step 22 and stopped (exit 130; re-run to resume)"; the same
command resumes it), so `train.py ... && evaluate.py ...` stops there too; 130 at once, with
nothing saved, for a Ctrl-C before the first step is dispatched (set-up, compilation) or a
second Ctrl-C while the run saves; 1 for an error (one line, `error: ...`).
"""
from absl import flags

from loopmoe_jax.cli import config_flag, distributed_flags, initialize_distributed, run

_CONFIG = config_flag()
_DISTRIBUTED = distributed_flags()
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory (checkpoints, metrics).',
                               required=True)
_FORCE = flags.DEFINE_bool('force', False, 'Skip the pre-flight memory check (a lower bound on '
                           'the bytes per device against the device memory; '
                           'loopmoe_jax/train/preflight.py).')
_START_OVER = flags.DEFINE_bool('start_over', False, 'When no checkpoint step of --workdir reads '
                                'back, start the run over from step 0 (its steps and logs are '
                                'moved to unreadable_checkpoints/); without it that is an error.')


def main(argv):
  del argv
  initialize_distributed(_DISTRIBUTED)
  from loopmoe_jax.train import preempt
  from loopmoe_jax.train.trainer import train
  summary = train(_CONFIG.value, _WORKDIR.value, force=_FORCE.value,
                  start_over=_START_OVER.value)
  return preempt.exit_status(summary.get('stopped_by'))  # 130/143 after a signal's save


if __name__ == '__main__':
  run(main)
