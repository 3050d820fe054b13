"""Compiles the train step for a target before any pod time is spent, and prints bytes per
device and collective traffic per step.

--target=NAME (loopmoe_jax/targets.py: v5p-128, v5p:4x4x4, v6e:8x8, h200x8, 2x8xh100, ...)
compiles it with that accelerator's own compiler on this CPU (compile-only devices; the extra:
pip install -e '.[tpu]' or '.[cuda]'): bytes per device from the compiled program against the
device's memory, the compiled program's collectives, time bounds (loopmoe_jax/aot.py).
--platform (no target) is the CPU proxy: XLA:CPU on fake CPU devices (loopmoe_jax/dry_run.py),
for a machine without the extras; its temporaries are XLA:CPU's, 2-4x a TPU's or GPU's.

    python scripts/dry_run.py --config=configs/foil.py:foil2 --target=v5p-128 \
        --config.mesh.data=1 --config.mesh.fsdp=8 --config.mesh.expert=8 \
        --config.data.batch_size=128 --json /tmp/dry.json
    python scripts/dry_run.py --config=configs/foil.py:foil2 --target=h200x8 \
        --config.mesh.data=1 --config.mesh.expert=8 --remat_policies=all
    python scripts/dry_run.py --config=configs/foil.py:foil2,smoke --target=rtx4090x1 \
        --config.mesh.data=1   # one 24 GB card: Triton kernels (sm_89), said in a note
    python scripts/dry_run.py --config=configs/foil.py:foil2 --devices 64 --platform tpu \
        --config.mesh.data=1 --config.mesh.fsdp=8 --config.mesh.expert=8   # CPU proxy
"""
import json

from absl import flags

from loopmoe_jax.cli import config_flag, run

_CONFIG = config_flag()
_DEVICES = flags.DEFINE_integer('devices', 8, 'Fake CPU devices (the CPU proxy\'s mesh size).')
_JSON = flags.DEFINE_string('json', None, 'Write the report here as JSON.')
_PLATFORM = flags.DEFINE_string('platform', 'cpu', 'cpu | tpu | cuda: the program the CPU '
                                'proxy counts (without --target).')
_TARGET = flags.DEFINE_string('target', None, 'An accelerator target: compile with its real '
                              'compiler (loopmoe_jax/targets.py lists the names).')
_PRESET = flags.DEFINE_string('compiler_preset', 'pod', 'pod | none: the platform\'s pod '
                              'compiler flags (loopmoe_jax/aot.py) or the compiler defaults.')
_FAMILY = flags.DEFINE_string('kernel_family', None, 'A Pallas kernel family for every '
                              'grouped matmul (gpu: Triton, mgpu / mgpu_ws: Mosaic GPU, sm_90+; '
                              'tpu); default: what the target chip runs.')
_POLICIES = flags.DEFINE_list('remat_policies', [], 'Also compile the step once per run.remat '
                              'policy listed (all: every one) and print temporaries and FLOPs.')


def main(argv):
  del argv
  import jax
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', _DEVICES.value)
  import time
  from loopmoe_jax import aot
  from loopmoe_jax.config import REMAT_POLICIES
  from loopmoe_jax.dry_run import check_platform, dry_run, remat_policies
  from loopmoe_jax.tables import policy_table, table, target_table
  target = None
  if _TARGET.value:  # before any compile: a bad name or a missing extra
    target = aot.target_for(_TARGET.value, _PRESET.value, _FAMILY.value)
  else:
    check_platform(_PLATFORM.value)
  names = list(REMAT_POLICIES) if _POLICIES.value == ['all'] else _POLICIES.value
  unknown = [p for p in names if p not in REMAT_POLICIES]
  if unknown:
    raise ValueError(f'--remat_policies: unknown {unknown}; known {list(REMAT_POLICIES)}')
  start = time.perf_counter()
  if target:
    report = aot.target_report(_CONFIG.value, target, _PRESET.value)
    if report.get('refused'):  # nothing compiled: the figures the compiler gave, one line
      _write(report)
      raise ValueError(aot.does_not_fit(report))
  else:
    report = dry_run(_CONFIG.value, _PLATFORM.value)
    report['compiler'] = 'cpu-proxy'
  report['wall_s'] = round(time.perf_counter() - start, 1)
  print(f"dry run took {report['wall_s']} s", flush=True)
  print(table(report), flush=True)
  if target:
    print(target_table(report), flush=True)
  if names:
    if target:
      report['remat_policies'] = {p: aot.candidate(_CONFIG.value, target, {'run.remat': p},
                                                   _PRESET.value) for p in names}
    else:
      report['remat_policies'] = remat_policies(_CONFIG.value, names)
    print(policy_table(report['remat_policies']), flush=True)
  _write(report)


def _write(report: dict):
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(report, f, indent=1)


if __name__ == '__main__':
  run(main)
