"""Plans a run on a target: every split of its devices over data x fsdp x expert x tensor,
screened without compiling (what cannot divide is skipped with the reason; a memory floor over
the device is dropped), the best few by an analytic step time searched by real compiles (remat,
microbatches, loss chunk: scripts/fit.py's search, a candidate the compiler refuses being a
row that does not fit), ranked by the compiled program's estimated step time
(loopmoe_jax/plan.py). Prints the table and the train command of the best plan.

    python scripts/plan.py --config=configs/smelt.py:200m,looped --target=v5p-128 \
        --config.data.batch_size=128 --json /tmp/plan.json
    python scripts/plan.py --config=configs/foil.py:foil2 --target=h200x8 \
        --config.data.batch_size=96 --search run.remat=attention,full --meshes 2
"""
import json
import sys

from absl import flags

from loopmoe_jax.cli import config_flag, run, search_flags

_CONFIG = config_flag()
_SEARCHED = search_flags()  # --target, --search (per mesh), --compiler_preset
_MESHES = flags.DEFINE_integer('meshes', 3, 'Meshes to compile, the best by the analytic '
                               'estimate first.')
_JSON = flags.DEFINE_string('json', None, 'Write the target, the candidates and the best here.')


def main(argv):
  del argv
  import jax
  jax.config.update('jax_platforms', 'cpu')
  from loopmoe_jax import aot, fit, plan
  if _MESHES.value < 1:
    raise ValueError(f'--meshes={_MESHES.value}: must be >= 1 (the meshes to compile)')
  preset, given = _SEARCHED['preset'].value, _SEARCHED['search'].value
  target = aot.target_for(_SEARCHED['target'].value, preset)
  search = fit.parse_search(given) if given else None
  rows, best = plan.plan(_CONFIG.value, target, search, preset, _MESHES.value,
                         log=lambda s: print(s, flush=True))
  spec = next((a.split('=', 1)[1] for a in sys.argv[1:] if a.startswith('--config=')),
              'configs/default.py')
  kept = [a for a in sys.argv[1:] if a.startswith('--config.') and
          not a.startswith('--config.mesh.')]
  result = {'target': target.describe(), 'candidates': rows, 'best': None}
  if best is None:
    print('no plan fits: no compiled mesh fits the device memory; lower data.batch_size, '
          'or compile more meshes (--meshes)', flush=True)
  else:
    result['best'] = dict(rows[best], command=plan.command(spec, kept, rows[best]))
    print(f"best: {plan.line(rows[best])}\n{result['best']['command']}", flush=True)
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(result, f, indent=1)


if __name__ == '__main__':
  run(main)
