"""Validation loss of a checkpoint; --num_loops changes the passes (test-time recurrence).

    python scripts/evaluate.py --workdir=/tmp/run [--num_loops=6] [--step=400]
        [--scale_passes=executed]   # SMELT's 1/r by the executed passes
    python scripts/evaluate.py --workdir=/tmp/run --kv_cache=per_pass,last_pass,first_pass
        # the validation text decoded one token at a time under each KV-cache layout
        # (model.kv_cache, decode.py), beside the full forward's loss on the same tokens
"""
import json

from absl import flags

from loopmoe_jax.cli import run

_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory.', required=True)
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest readable).')
_LOOPS = flags.DEFINE_list('num_loops', [], 'Pass counts to evaluate (default: trained).')
_SCALE = flags.DEFINE_enum('scale_passes', None, ['trained', 'executed'],
                           'r of the 1/r residual scale at another pass count (default: the '
                           "model's model.scale_passes, 'trained' unless set).")
_KV = flags.DEFINE_list('kv_cache', [], 'KV-cache layouts to compare (per_pass, last_pass, '
                        'first_pass): the loss of the validation batches decoded one token at '
                        'a time under each (decode.decode_nll).')


def kv_cache_losses(workdir, layouts, num_loops, step, scale_passes) -> dict:
  """{'full_forward': loss, 'decode': {layout: loss}} per pass count: the mean next-token
  NLL over the validation batches' unmasked targets, the text fed token by token."""
  import jax
  import numpy as np
  from loopmoe_jax.data import pipeline
  from loopmoe_jax.decode import decode_nll
  from loopmoe_jax.model import LoopedMoE, check_loops, variables
  from loopmoe_jax.objective import token_nll_of_logits
  from loopmoe_jax.train.run import as_loaded
  loaded = as_loaded(workdir, step)
  cfg, params, bias = loaded.model_cfg, loaded.params, loaded.router_bias
  if scale_passes:
    cfg = cfg.replace(scale_passes=scale_passes)
  configs = {k: cfg.replace(kv_cache=k) for k in layouts}  # a bad layout fails here, naming it
  for n in num_loops:
    check_loops(cfg, n)
  batches = pipeline.validation_batches(loaded.exp.data, cfg.vocab_size)
  if not batches:
    raise ValueError(f'{loaded.workdir}: the run has no validation data (data.val_path is empty)')
  forward = jax.jit(lambda p, b, t, n: LoopedMoE(cfg).apply(variables(p, router_bias=b), t,
                                                            num_loops=n)[0],
                    static_argnums=3)

  def mean(nll_fn):
    total = count = 0.0
    for b in batches:
      mask = np.asarray(b['mask'], np.float64)
      total += float(np.sum(np.asarray(nll_fn(b), np.float64) * mask))
      count += float(mask.sum())
    return total / max(count, 1.0)

  out = {'step': loaded.step, 'tokens': int(sum(np.asarray(b['mask']).sum() for b in batches))}
  for n in num_loops:
    row = {'full_forward': mean(lambda b: token_nll_of_logits(
        forward(params, bias, b['inputs'], n), b['targets']))}
    row['decode'] = {k: mean(lambda b, c=c: decode_nll(c, params, b['inputs'], b['targets'], n,
                                                       bias))
                     for k, c in configs.items()}
    out[str(n or cfg.num_loops)] = row
  return out


def main(argv):
  del argv
  from loopmoe_jax.train.evaluation import evaluate_checkpoint
  try:
    loops = [int(n) for n in _LOOPS.value] or [None]
  except ValueError:
    raise ValueError(f'--num_loops={",".join(_LOOPS.value)}: pass counts must be integers') from None
  if _KV.value:
    out = kv_cache_losses(_WORKDIR.value, _KV.value, loops, _STEP.value, _SCALE.value)
  else:
    out = evaluate_checkpoint(_WORKDIR.value, loops, _STEP.value, _SCALE.value)
  print(json.dumps(out, indent=1))


if __name__ == '__main__':
  run(main)
