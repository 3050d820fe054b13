"""Compiles the train step for a target mesh on fake CPU devices (no arrays) and prints bytes
per device and collective traffic per step, before any pod time is spent. --platform tpu|cuda
counts the collectives of the program that platform runs (ragged exchange, its dtypes) and
lowers the step for it with its Pallas kernels (loopmoe_jax/dry_run.py says how).

    python scripts/dry_run.py --config=configs/foil.py:foil2 --devices 64 --platform tpu \
        --config.mesh.data=1 --config.mesh.fsdp=8 --config.mesh.expert=8 --json /tmp/dry.json
    python scripts/dry_run.py --config=configs/foil.py:foil2 --devices 1 --remat_policies=all \
        --config.data.batch_size=2      # temporaries and FLOPs per run.remat policy
"""
import json

from absl import flags

from loopmoe_jax.cli import config_flag, run

_CONFIG = config_flag()
_DEVICES = flags.DEFINE_integer('devices', 8, 'Fake CPU devices (the target mesh size).')
_JSON = flags.DEFINE_string('json', None, 'Write the report here as JSON.')
_PLATFORM = flags.DEFINE_string('platform', 'cpu', 'cpu | tpu | cuda: the program to count.')
_POLICIES = flags.DEFINE_list('remat_policies', [], 'Also compile the step once per run.remat '
                              'policy listed (all: every one) and print temporaries and FLOPs.')


def main(argv):
  del argv
  import jax
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', _DEVICES.value)
  import time
  from loopmoe_jax.dry_run import check_platform, dry_run, table
  from loopmoe_jax.config import REMAT_POLICIES
  from loopmoe_jax.dry_run import policy_table, remat_policies
  check_platform(_PLATFORM.value)  # before any compile
  names = list(REMAT_POLICIES) if _POLICIES.value == ['all'] else _POLICIES.value
  unknown = [p for p in names if p not in REMAT_POLICIES]
  if unknown:
    raise ValueError(f'--remat_policies: unknown {unknown}; known {list(REMAT_POLICIES)}')
  start = time.perf_counter()
  report = dry_run(_CONFIG.value, _PLATFORM.value)
  report['wall_s'] = round(time.perf_counter() - start, 1)
  print(f"dry run took {report['wall_s']} s", flush=True)
  print(table(report), flush=True)
  if names:
    report['remat_policies'] = remat_policies(_CONFIG.value, names)
    print(policy_table(report['remat_policies']), flush=True)
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(report, f, indent=1)


if __name__ == '__main__':
  run(main)
