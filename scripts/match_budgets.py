"""SMELT three-budget matching: a looped twin with the baseline's FLOPs, params and KV cache.

    python scripts/match_budgets.py --baseline=configs/smelt.py:200m,baseline \
        --span=0.5 --loops=2 --json /tmp/match.json
    python scripts/match_budgets.py --baseline=configs/smelt.py:200m,baseline \
        --fix=d_model=1056,core_experts=288 --context=2048     # SMELT's published twin

Prints the three ratios (twin / baseline), the matched model config and the
`python scripts/train.py --config=... --config.X=...` command that trains the twin; --json writes
`flops_ratio`, `params_ratio`, `kv_ratio`, `max_deviation`, `model` (every ModelConfig
field) and the budgets. FLOPs use the baseline's data.seq_len as the context.
"""
import dataclasses
import json
import shlex

from absl import flags
from ml_collections import config_flags

from loopmoe_jax.cli import check_output_file, run
from loopmoe_jax.config import ModelConfig

_BASELINE = config_flags.DEFINE_config_file('baseline', None, 'Baseline config file[:arg].')
_SPAN = flags.DEFINE_float('span', 0.5, 'Fraction of the layers looped (the middle span).')
_LOOPS = flags.DEFINE_integer('loops', 2, 'Passes over the looped span.')
_TOL = flags.DEFINE_float('tol', 0.04, 'Largest allowed |ratio - 1| on every budget.')
_WIDTH = flags.DEFINE_bool('search_expert_width', False, 'Also search the expert width.')
_CONTEXT = flags.DEFINE_integer('context', 0, 'Context for FLOPs; 0: the baseline seq_len.')
_FIX = flags.DEFINE_list('fix', [], 'Twin fields held fixed, e.g. d_model=1056,core_experts=288.')
_MULTIPLE = flags.DEFINE_integer('multiple_of', 0, 'Width, expert width and head size as '
                                 'multiples of this (0: the defaults, 32/16/2).')
_JSON = flags.DEFINE_string('json', None, 'Write the result here.')


def main(argv):
  del argv
  from loopmoe_jax.scaling.matching import match
  check_output_file('--json', _JSON.value)  # before the search, not after it
  spec = config_flags.get_config_filename(flags.FLAGS['baseline'])
  cfg = _BASELINE.value
  base = ModelConfig.from_dict(cfg.model)
  if base.num_loops != 1:
    raise ValueError(f'--baseline={spec} has model.num_loops={base.num_loops}: the baseline '
                     'must be unlooped; add --baseline.model.num_loops=1 (or give its '
                     'unlooped variant)')
  context = _CONTEXT.value or cfg.data.seq_len
  steps = {}
  if _MULTIPLE.value:
    steps = dict(d_step=_MULTIPLE.value, width_step=_MULTIPLE.value, head_step=_MULTIPLE.value)
  try:
    m = match(base, span=_SPAN.value, loops=_LOOPS.value, context=context, tol=_TOL.value,
              search_expert_width=_WIDTH.value, fixed=fixed_fields(_FIX.value), **steps)
  except ValueError as e:
    if not str(e).startswith('no looped twin'):
      raise
    hint = ('add --search_expert_width (the expert width is searched too, 0.5x to 1.25x)'
            if not _WIDTH.value else 'try another --span or --loops, or a looser --tol')
    raise ValueError(f'{e}: {hint}') from None
  print(f'ratios (twin / baseline; FLOPs per token at context {context}):')
  for name, value in m.ratios.items():
    print(f'  {name}: {value:.4f}')
  changed = {k: v for k, v in dataclasses.asdict(m.config).items()
             if getattr(base, k) != v}
  print('matched model (fields changed from the baseline): ' + json.dumps(changed))
  print('train it:\n  ' + train_command(spec, cfg, m.config))
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(m.to_json(), f, indent=1)


def fixed_fields(items) -> dict:
  """--fix's FIELD=INTEGER items as a dict; a ValueError naming a bad item."""
  fixed = {}
  for item in items:
    key, eq, val = item.partition('=')
    if not eq or not val.strip().isdigit():
      raise ValueError(f'--fix={item!r}: expected FIELD=INTEGER')
    fixed[key.strip()] = int(val)
  return fixed


def train_command(spec: str, cfg, twin: ModelConfig) -> str:
  """`python scripts/train.py --config=SPEC --config.X=...` training the twin: its model
  fields that differ from the config file's, and every other field the --baseline.X
  overrides changed."""
  from loopmoe_jax.experiment import load_config, split_run
  file_cfg = load_config(spec).to_dict()
  given = cfg.to_dict()
  file_model = ModelConfig.from_dict(split_run(file_cfg)[0])
  sets = {f'model.{k}': v for k, v in dataclasses.asdict(twin).items()
          if getattr(file_model, k) != v}
  for section, fields in given.items():
    if section != 'model' and isinstance(fields, dict):
      sets.update({f'{section}.{k}': v for k, v in fields.items()
                   if file_cfg.get(section, {}).get(k) != v})
  words = ['python scripts/train.py', shlex.quote(f'--config={spec}')]
  words += [shlex.quote(f'--config.{k}={v}') for k, v in sets.items()]
  return ' '.join(words + ['--workdir=RUN_DIR'])


if __name__ == '__main__':
  flags.mark_flag_as_required('baseline')
  run(main)
