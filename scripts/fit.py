"""The fit finder: searches the run settings that change memory and not results (remat policy,
microbatches, loss chunk; attention implementation and the per-device batch when asked) by
real compiles for an accelerator target, cheapest first, and prints each candidate's bytes per
device, fit and FLOPs over remat=none, the cheapest that fits marked (loopmoe_jax/fit.py).
Compiles are kept on disk, so a rerun is quick.

    python scripts/fit.py --config=configs/foil.py:foil2 --target=h200x8 \
        --config.mesh.data=1 --config.mesh.expert=8 --json /tmp/fit.json
    python scripts/fit.py --config=configs/foil.py:foil2 --target=a100x1 --config.mesh.data=1 \
        --search data.batch_size_per_device=96,8,1 --search train.microbatches=1,8,96
    python scripts/fit.py --config=configs/foil.py:foil2 --target=v5p-128 \
        --config.mesh.data=1 --config.mesh.fsdp=8 --config.mesh.expert=8 \
        --search run.remat=none,full --search data.batch_size_per_device=2,4 --exhaustive
"""
import json

from absl import flags

from loopmoe_jax.cli import config_flag, run, search_flags

_CONFIG = config_flag()
_SEARCHED = search_flags()
_EXHAUSTIVE = flags.DEFINE_bool('exhaustive', False, 'Compile every candidate, not only up to '
                                'the cheapest that fits.')
_HBM = flags.DEFINE_float('hbm_gib', None, 'Memory per device to fit in (GiB); default the '
                          "target's.")
_FAMILY = flags.DEFINE_string('kernel_family', None, 'A Pallas kernel family for every '
                              'grouped matmul; default: what the target chip runs.')
_JSON = flags.DEFINE_string('json', None, 'Write the candidates and the best here as JSON.')


def main(argv):
  del argv
  import jax
  jax.config.update('jax_platforms', 'cpu')
  from loopmoe_jax import aot, fit, targets
  preset = _SEARCHED['preset'].value
  target = aot.target_for(_SEARCHED['target'].value, preset, _FAMILY.value)
  if _HBM.value:
    target = targets.with_memory(target, _HBM.value * 2**30)
  given = _SEARCHED['search'].value
  search = fit.parse_search(given) if given else dict(fit.SEARCH)
  rows, best = fit.find(_CONFIG.value, target, search, preset, _EXHAUSTIVE.value,
                        log=lambda s: print(s, flush=True))
  print(fit.table(rows, best, target), flush=True)
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump({'target': target.describe(), 'candidates': rows,
                 'best': rows[best] if best is not None else None}, f, indent=1)


if __name__ == '__main__':
  run(main)
