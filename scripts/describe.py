"""Prints the accounting of a config as one JSON object; for a looped SMELT variant also its
three budget ratios against the baseline of the same depth ('smelt_match').

    python scripts/describe.py --config=configs/foil.py:foil1 [--init] [--context=4096]
    python scripts/describe.py --config=configs/smelt.py:200m,looped,loops=3
    python scripts/describe.py --fields [--config=configs/foil.py:foil1]   # every config field:
        # its value in that config, and what it means (--config.SECTION.FIELD=... sets it)
"""
import json
import os
import sys

from absl import flags

from loopmoe_jax.cli import config_flag, run
from loopmoe_jax.accounting import count, init_param_count

_CONFIG = config_flag()
_INIT = flags.DEFINE_bool('init', False, 'Also count the real init params (jax.eval_shape).')
_FIELDS = flags.DEFINE_bool('fields', False, 'List every config field instead: its value in '
                            '--config and one line of what it means.')
_CONTEXT = flags.DEFINE_integer('context', 2048, 'Context length for attention FLOPs.',
                                lower_bound=1)


def main(argv):
  del argv
  if _FIELDS.value:
    from loopmoe_jax.config.listing import field_rows, format_rows
    print(format_rows(field_rows(_CONFIG.value)))
    return
  from loopmoe_jax.experiment import build, load_config
  from loopmoe_jax.scaling.matching import ratios
  cfg = build(_CONFIG.value).model
  out = count(cfg, _CONTEXT.value)
  if _INIT.value:
    out['params_init'] = init_param_count(cfg)
  spec = next((a.split('=', 1)[1] for a in sys.argv if a.startswith('--config=')), '')
  if os.path.basename(spec.partition(':')[0]) == 'smelt.py' and cfg.num_loops > 1:
    base = build(load_config(spec + ',variant=baseline')).model
    r, _ = ratios(cfg, count(base, _CONTEXT.value), _CONTEXT.value)
    out['smelt_match'] = {k: round(v, 4) for k, v in r.items()}
  print(json.dumps(out, indent=1))


if __name__ == '__main__':
  run(main)
