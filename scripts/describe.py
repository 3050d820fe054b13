"""Prints the accounting of a config as one JSON object.

    python scripts/describe.py --config=configs/foil.py:foil1 [--init] [--context=4096]
"""
import json

from absl import app, flags
from ml_collections import config_flags

from loopmoe_jax.accounting import count, init_param_count
from loopmoe_jax.config import ModelConfig

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config file[:arg].')
_INIT = flags.DEFINE_bool('init', False, 'Also count the real init params (jax.eval_shape).')
_CONTEXT = flags.DEFINE_integer('context', 2048, 'Context length for attention FLOPs.')


def main(argv):
  del argv
  cfg = ModelConfig.from_dict(_CONFIG.value.model)
  out = count(cfg, _CONTEXT.value)
  if _INIT.value:
    out['params_init'] = init_param_count(cfg)
  print(json.dumps(out, indent=1))


if __name__ == '__main__':
  app.run(main)
