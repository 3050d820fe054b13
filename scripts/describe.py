"""Prints the accounting of a config as one JSON object.

    python scripts/describe.py --config=configs/foil.py:foil1 [--init] [--context=4096]
"""
import json

from absl import flags

from loopmoe_jax.cli import config_flag, run
from loopmoe_jax.accounting import count, init_param_count
from loopmoe_jax.config import ModelConfig

_CONFIG = config_flag()
_INIT = flags.DEFINE_bool('init', False, 'Also count the real init params (jax.eval_shape).')
_CONTEXT = flags.DEFINE_integer('context', 2048, 'Context length for attention FLOPs.',
                                lower_bound=1)


def main(argv):
  del argv
  cfg = ModelConfig.from_dict(_CONFIG.value.model)
  out = count(cfg, _CONTEXT.value)
  if _INIT.value:
    out['params_init'] = init_param_count(cfg)
  print(json.dumps(out, indent=1))


if __name__ == '__main__':
  run(main)
