"""Validation loss of a checkpoint; --num_loops changes the passes (test-time recurrence).

    python scripts/evaluate.py --workdir=/tmp/run [--num_loops=6] [--step=400]
        [--scale_passes=executed]   # SMELT's 1/r by the executed passes
    python scripts/evaluate.py --workdir=/tmp/run --kv_cache=per_pass,last_pass,first_pass
        # the validation text decoded one token at a time under each KV-cache layout
        # (model.kv_cache, decode.py), beside the full forward's loss on the same tokens
    python scripts/evaluate.py --workdir=/tmp/run --exit=kl --thresholds=1e-3,1e-2,0.1 \
        --out=/tmp/exit.png   # per-token early exit (model.exit, early_exit.py): loss and average
        # passes per threshold (a trade-off table), and a PNG of loss against average passes
"""
import json

from absl import flags

from loopmoe_jax.cli import (check_output_file, distributed_flags, initialize_distributed,
                             main_process, pass_counts, run)

_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory.', required=True)
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest readable).')
_LOOPS = flags.DEFINE_list('num_loops', [], 'Pass counts to evaluate (default: trained).')
_SCALE = flags.DEFINE_enum('scale_passes', None, ['trained', 'executed'],
                           'r of the 1/r residual scale at another pass count (default: the '
                           "model's model.scale_passes, 'trained' unless set).")
_KV = flags.DEFINE_list('kv_cache', [], 'KV-cache layouts to compare (per_pass, last_pass, '
                        'first_pass): the loss of the validation batches decoded one token at '
                        'a time under each (decode.decode_nll).')
_EXIT = flags.DEFINE_enum('exit', None, ['kl', 'gate'], 'Early-exit rule (model.exit) to '
                          'sweep over --thresholds.')
_THRESH = flags.DEFINE_list('thresholds', [], 'model.exit_threshold values for --exit.')
_OUT = flags.DEFINE_string('out', None, 'PNG of loss against average passes (--exit).')
_DISTRIBUTED = distributed_flags()


def main(argv):
  del argv
  loops = pass_counts(_LOOPS.value)
  if _EXIT.value and (_KV.value or _SCALE.value):  # flags that would be ignored are refused
    raise ValueError(f'--exit={_EXIT.value} takes neither --kv_cache nor --scale_passes: run them '
                     'separately')
  if not _EXIT.value and (_THRESH.value or _OUT.value):
    raise ValueError('--thresholds and --out belong to --exit=kl|gate: add --exit or drop them')
  check_output_file('--out', _OUT.value)  # before the evaluation, not after it
  initialize_distributed(_DISTRIBUTED)  # every process evaluates; process 0 prints
  from loopmoe_jax.train.evaluation import evaluate_checkpoint
  if _EXIT.value:
    from loopmoe_jax.train import depth_eval
    out = depth_eval.exit_tradeoff(_WORKDIR.value, _EXIT.value, _THRESH.value, loops,
                                   _STEP.value)
    if main_process():
      print(depth_eval.tradeoff_table(out))
    if _OUT.value and main_process():
      out['plot'] = depth_eval.plot_tradeoff(out, _OUT.value)
  elif _KV.value:
    from loopmoe_jax.train.depth_eval import kv_cache_losses
    out = kv_cache_losses(_WORKDIR.value, _KV.value, loops, _STEP.value, _SCALE.value)
  else:
    out = evaluate_checkpoint(_WORKDIR.value, loops, _STEP.value, _SCALE.value)
  if main_process():
    print(json.dumps(out, indent=1))


if __name__ == '__main__':
  run(main)
