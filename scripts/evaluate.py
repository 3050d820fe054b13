"""Validation loss of a checkpoint; --num_loops changes the passes (test-time recurrence).

    python scripts/evaluate.py --workdir=/tmp/run [--num_loops=6] [--step=400]
        [--scale_passes=executed]   # SMELT's 1/r by the executed passes
    python scripts/evaluate.py --workdir=/tmp/run --kv_cache=per_pass,last_pass,first_pass
        # the validation text decoded one token at a time under each KV-cache layout
        # (model.kv_cache, decode.py), beside the full forward's loss on the same tokens
    python scripts/evaluate.py --workdir=/tmp/run --exit=kl --thresholds=1e-3,1e-2,0.1 \
        --out=/tmp/exit.png   # per-token early exit (model.exit, exit.py): loss and average
        # passes per threshold (a trade-off table), and a PNG of loss against average passes
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
_EXIT = flags.DEFINE_enum('exit', None, ['kl', 'gate'], 'Early-exit rule (model.exit) to '
                          'sweep over --thresholds.')
_THRESH = flags.DEFINE_list('thresholds', [], 'model.exit_threshold values for --exit.')
_OUT = flags.DEFINE_string('out', None, 'PNG of loss against average passes (--exit).')


def exit_tradeoff(workdir, rule, thresholds, num_loops, step, out=None) -> dict:
  """{'rows': [{threshold, loss, mean_passes}]} on the validation batches (the full forward
  with early_exit=True, exited tokens frozen; the no-exit model as threshold None), and the
  PNG of loss against average passes at `out`."""
  import jax
  import numpy as np
  from loopmoe_jax.data import pipeline
  from loopmoe_jax.model import LoopedMoE, variables
  from loopmoe_jax.objective import token_nll_of_logits
  from loopmoe_jax.train.run import as_loaded
  if not thresholds:
    raise ValueError('--exit needs --thresholds=a,b,c (model.exit_threshold values)')
  try:
    values = [float(t) for t in thresholds]
  except ValueError:
    raise ValueError(f'--thresholds={",".join(thresholds)}: must be numbers') from None
  loaded = as_loaded(workdir, step)
  base = loaded.model_cfg
  configs = [(None, base.replace(exit='none'))] + [
      (t, base.replace(exit=rule, exit_threshold=t)) for t in values]  # bad ones fail here
  batches = pipeline.validation_batches(loaded.exp.data, base.vocab_size)
  if not batches:
    raise ValueError(f'{loaded.workdir}: the run has no validation data (data.val_path is empty)')
  rows = []
  for t, cfg in configs:
    fn = jax.jit(lambda p, b, x, cfg=cfg: LoopedMoE(cfg).apply(
        variables(p, router_bias=b), x, num_loops=num_loops, early_exit=t is not None))
    total = passes = count = 0.0
    for b in batches:
      logits, extras = fn(loaded.params, loaded.router_bias, b['inputs'])
      mask = np.asarray(b['mask'], np.float64)
      total += float(np.sum(np.asarray(token_nll_of_logits(logits, b['targets'])) * mask))
      n = np.asarray(extras['exit']['passes_BT']) if 'exit' in extras else num_loops or \
          base.num_loops
      passes += float(np.sum(n * mask))
      count += float(mask.sum())
    rows.append({'threshold': t, 'loss': total / max(count, 1.0),
                 'mean_passes': passes / max(count, 1.0)})
  for r in rows:
    print(f"{rule if r['threshold'] is not None else 'none':>5} threshold="
          f"{r['threshold'] if r['threshold'] is not None else '-':<10} "
          f"loss={r['loss']:.4f} mean_passes={r['mean_passes']:.3f}")
  if out:
    from loopmoe_jax.scaling.plots import _pyplot
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ex = [r for r in rows if r['threshold'] is not None]
    ax.plot([r['mean_passes'] for r in ex], [r['loss'] for r in ex], 'o-', label=f'exit={rule}')
    for r in ex:
      ax.annotate(f"{r['threshold']:g}", (r['mean_passes'], r['loss']), fontsize=8)
    ax.scatter([rows[0]['mean_passes']], [rows[0]['loss']], color='k', marker='s',
               label='no exit', zorder=3)
    ax.set_xlabel('average passes per token')
    ax.set_ylabel('validation loss (nats)')
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
  return {'step': loaded.step, 'exit': rule, 'rows': rows, 'plot': out}


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
  if _EXIT.value:
    out = {}
    for n in loops:
      out[str(n or 'trained')] = exit_tradeoff(_WORKDIR.value, _EXIT.value, _THRESH.value, n,
                                               _STEP.value, _OUT.value)
  elif _KV.value:
    out = kv_cache_losses(_WORKDIR.value, _KV.value, loops, _STEP.value, _SCALE.value)
  else:
    out = evaluate_checkpoint(_WORKDIR.value, loops, _STEP.value, _SCALE.value)
  print(json.dumps(out, indent=1))


if __name__ == '__main__':
  run(main)
