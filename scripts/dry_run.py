"""Compiles the train step for a target mesh on fake CPU devices (no arrays) and prints bytes
per device and collective traffic per step, before any pod time is spent.

    python scripts/dry_run.py --config=configs/foil.py:foil2 --devices 64 \
        --config.mesh.data=1 --config.mesh.fsdp=8 --config.mesh.expert=8 --json /tmp/dry.json
"""
import json

from absl import flags

from loopmoe_jax.cli import config_flag, run

_CONFIG = config_flag()
_DEVICES = flags.DEFINE_integer('devices', 8, 'Fake CPU devices (the target mesh size).')
_JSON = flags.DEFINE_string('json', None, 'Write the report here as JSON.')


def main(argv):
  del argv
  import jax
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', _DEVICES.value)
  from loopmoe_jax.dry_run import dry_run, table
  report = dry_run(_CONFIG.value)
  print(table(report), flush=True)
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(report, f, indent=1)


if __name__ == '__main__':
  run(main)
