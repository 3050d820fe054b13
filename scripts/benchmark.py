"""Benchmarks, one sub-command each; prints a table and the results as JSON.

    python scripts/benchmark.py model [--quick] [--json=FILE]
    python scripts/benchmark.py data [--json=FILE]
    python scripts/benchmark.py kernels [--quick] [--json=FILE]
    python scripts/benchmark.py scale [--quick] [--json=FILE]     # 8 devices (fake on CPU)
    python scripts/benchmark.py memory [--quick] [--json=FILE]    # compiled, nothing run
    python scripts/benchmark.py adaptive [--quick] [--json=FILE]  # sampled passes, early exit
    python scripts/benchmark.py decode [--quick] [--json=FILE]    # batched, loop-draft speculative
    python scripts/benchmark.py export [--quick] [--json=FILE]    # hf-looped bytes, torch speed

Sub-commands live in the modules of loopmoe_jax/bench/'s MODULES (imported on demand, so
`kernels` needs neither the data stack nor its packages).
"""
import os

from absl import app, flags

from loopmoe_jax import bench

_JSON = flags.DEFINE_string('json', None, 'Also write the results dict to this JSON file.')
_QUICK = flags.DEFINE_bool('quick', False, 'Fast smoke run: fewer repeats, smaller sizes.')


def main(argv):
  if len(argv) != 2:
    raise app.UsageError(f'usage: benchmark.py SUBCOMMAND [flags]; '
                         f'SUBCOMMAND one of {sorted(bench.MODULES)}')
  if argv[1] not in bench.MODULES:
    raise app.UsageError(f'unknown sub-command {argv[1]!r}; known {sorted(bench.MODULES)}')
  if argv[1] == 'scale' and 'JAX_NUM_CPU_DEVICES' not in os.environ:
    import jax
    jax.config.update('jax_num_cpu_devices', 8)  # fake devices when the platform is CPU
    if 'JAX_PLATFORMS' not in os.environ:
      # the 8 fake CPU devices, as the dry run: a CUDA plugin left to start without a GPU
      # fails, and then cannot give the compile-only GPU topology the benchmark compiles for
      jax.config.update('jax_platforms', 'cpu')
  bench.run(argv[1], quick=_QUICK.value, json_path=_JSON.value)


if __name__ == '__main__':
  app.run(main)
