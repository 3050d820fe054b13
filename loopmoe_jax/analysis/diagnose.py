"""`scripts/diagnose.py`: every routing diagnostic of a checkpoint over a probe set, as
OUT/diagnostics.json and PNG heatmaps (definitions in diagnostics.py / docs/formulas.md).

Per core layer, per pass and overall for the looped core; prelude and coda MoE layers (one pass
each) get load, N2/B2, MaxVio and MMR. Diagnostics that do not apply to the model (no looped
core, no experts) are listed under 'not_applicable' with the reason, and the rest computed.
The probe set (probe_set.py) is `tokens` held-out tokens, by default the scale's: Foil's
255,500 at gpu scale (Sec. 2.3), 16,384 at cpu scale; 'probe_set' in the JSON and the first
printed line say which (count, split, how chosen).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from loopmoe_jax.analysis import diagnostics, heatmaps, masking, probe_set
# under other names: `evals` and `probes` are diagnose's options
from loopmoe_jax.analysis import evals as ev
from loopmoe_jax.analysis import probes as mech
from loopmoe_jax.train.run import RunDir


def _plain(x):
  if isinstance(x, dict):
    return {str(k): _plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_plain(v) for v in x]
  if isinstance(x, np.ndarray):
    return _plain(x.tolist())
  if isinstance(x, (np.floating, float)):
    return None if not np.isfinite(x) else float(x)
  if isinstance(x, np.integer):
    return int(x)
  return x


def segment_report(seg: str, rec: dict, num_experts: int, batch_tokens: int) -> dict:
  sel, logits = rec['experts'], rec['logits']
  bal = diagnostics.balance(sel, num_experts)
  vio = diagnostics.maxvio(sel, num_experts)
  # per probe batch; the last holds fewer probe tokens when the count is no whole batch
  per_batch = np.stack([diagnostics.maxvio(sel[i:i + batch_tokens], num_experts)['global']
                        for i in range(0, sel.shape[0], batch_tokens)])
  agg = diagnostics.mmr_aggregates(logits)
  out = {'num_experts': num_experts, 'layers': sel.shape[1], 'passes': sel.shape[2],
         'top_k': sel.shape[3], 'load_share_pooled': bal['share_pooled'],
         'N2': bal['N2'], 'B2_pooled': bal['B2_pooled'],
         'MaxVio_global': vio['global'], 'MaxVio_per_batch_mean': per_batch.mean(0),
         'MaxVio_per_batch_max': per_batch.max(0),
         'MMR_per_layer': agg['per_layer'], 'MMR_overall': agg['overall']}
  if seg == 'core':
    u = diagnostics.distinct_experts(sel, num_experts)
    out.update({'load_share_per_pass': bal['share_per_pass'], 'N2_per_pass': bal['N2_per_pass'],
                'B2_per_pass': bal['B2_per_pass'], 'MaxVio_global_per_pass': vio['global_per_pass'],
                'MMR_per_layer_pass': agg['per_layer_pass'], 'MMR_per_pass': agg['per_pass'],
                'U_mean': u['mean'], 'U_normalized': u['normalized'],
                'U_per_layer': u['per_layer'], 'U_bounds': [u['lower_bound'], u['upper_bound']]})
  return out


def not_applicable(cfg) -> dict:
  out = {}
  experts = probe_set.segment_experts(cfg)
  if not experts:
    out['all routing diagnostics'] = 'the model has no routed experts (dense feed-forward layers)'
    return out
  if 'core' not in experts:
    why = ('the model has no core layers' if not cfg.core_layers
           else 'the core layers are dense (model.core_experts=0)')
    out['U, per-pass load/B2/MaxVio/MMR, masking'] = why
  elif cfg.num_loops == 1:
    out['per-pass pooling'] = 'the core runs one pass (num_loops=1): pooled equals per pass'
  return out


@dataclasses.dataclass(frozen=True)
class _Options:
  """diagnose's counts, checked once (`check`), so that each step takes the few it reads."""
  tokens: int  # probe tokens, the scale's default already resolved
  mask_top: int
  mask_draws: int
  seed: int
  probes: int
  evals: int
  recurrence: int

  def check(self):
    """Raises ValueError naming the first count out of range (tokens must be > 0, the rest
    >= 0), as the command-line flag that sets it."""
    for name in ('tokens', 'mask_top', 'mask_draws', 'probes', 'evals', 'recurrence'):
      value = getattr(self, name)
      if value < 0 or (name == 'tokens' and value == 0):
        raise ValueError(f'--{name}={value}: must be {"> 0" if name == "tokens" else ">= 0"}')


def diagnose(workdir: str, out_dir: str, tokens: int | None = None, step: int | None = None,
             mask_top: int = 1, mask_draws: int = 4, seed: int = 0, log=print,
             probes: int = 0, evals: int = 0, recurrence: int = 0, scale: str = 'cpu') -> dict:
  """Writes out_dir/diagnostics.json and the heatmaps; returns the JSON's dict. The probe set
  is `tokens` held-out tokens (None: the `scale`'s default, probe_set.DEFAULT_TOKENS).
  Optional analyses of the same checkpoint (0 skips each): `probes` Q/K/V cosine between
  visits and sink mass over up to `probes` tokens of the probe set ('probes'); `evals` Dyck-k
  by shots and parity/addition/induction on that many examples each ('evals'); `recurrence`
  loss and task accuracy at passes 1..recurrence ('recurrence', and recurrence.png)."""
  tokens, chosen = probe_set.setting(tokens, scale)
  opts = _Options(tokens, mask_top, mask_draws, seed, probes, evals, recurrence)
  opts.check()
  t0 = time.perf_counter()
  run = _load(workdir, step, mask_top)  # read once: the evals and recurrence below reuse it
  params = run.variables
  batches, info = probe_set.probe_batches(run.config['data'], run.model_cfg, tokens)
  info['setting'] = chosen
  log(f'probe set: {probe_set.describe(info)}')
  t1 = time.perf_counter()
  res = probe_set.run(run.model_cfg, params, batches,
                      record=bool(probe_set.segment_experts(run.model_cfg)),
                      tokens=info['tokens'], runtime=run.runtime)
  t2 = time.perf_counter()
  report = _routing_report(workdir, run, info, res)
  os.makedirs(out_dir, exist_ok=True)
  figures = _heatmaps(report, out_dir)
  report['masking'] = _masking(report, run, params, batches, opts)
  t3 = time.perf_counter()
  report['timing_s'] = _timing((t0, t1, t2, t3), info['tokens'], res['timing'])
  ran, more = _analyses(report, run, params, batches, out_dir, opts)
  report['timing_s']['analyses_after_masking'] = time.perf_counter() - t3
  report['timing_s']['after_masking'] = ran  # only the analyses that ran
  report['figures'] = figures + more
  report = _plain(report)
  with open(os.path.join(out_dir, 'diagnostics.json'), 'w') as f:
    json.dump(report, f, indent=1)
  return report


def _load(workdir: str, step: int | None, mask_top: int):
  """The checkpoint (the latest when `step` is None), refused when `mask_top` leaves a token
  fewer than top_k unmasked core experts."""
  run = RunDir(workdir).load(step)
  cfg = run.model_cfg
  if cfg.core_experts and mask_top > cfg.core_experts - cfg.top_k:
    raise ValueError(f'--mask_top={mask_top}: must be <= model.core_experts - model.top_k = '
                     f'{cfg.core_experts - cfg.top_k} (a token needs top_k unmasked experts)')
  return run


def _routing_report(workdir: str, run, info: dict, res: dict) -> dict:
  """The report's head: the checkpoint, the probe set, its loss, what does not apply, and
  per segment with routing records its diagnostics (segment_report)."""
  cfg = run.model_cfg
  experts = probe_set.segment_experts(cfg)
  report = {'workdir': workdir, 'step': run.step, 'probe_set': info, 'loss': res['loss'],
            'not_applicable': not_applicable(cfg), 'segments': {}}
  routing = res.get('routing', {})
  for seg in probe_set.SEGMENTS:
    if seg in routing:
      report['segments'][seg] = segment_report(seg, routing[seg], experts[seg][1],
                                               info['batch_tokens'])
  return report


def _heatmaps(report: dict, out_dir: str) -> list[str]:
  """Writes the expert-load heatmap (every routed segment) and the core's MMR heatmap into
  out_dir; returns their paths."""
  s, info, segments = report['step'], report['probe_set'], report['segments']
  figures = []
  if segments:
    shares = {seg: (r['load_share_per_pass'] if seg == 'core' else
                    np.asarray(r['load_share_pooled'])[:, None, :])
              for seg, r in segments.items()}
    path = os.path.join(out_dir, 'expert_load.png')
    heatmaps.load_heatmap(path, shares, f'expert load share by layer and pass (step {s}, '
                          f'{info["tokens"]} tokens)')
    figures.append(path)
  if 'core' in segments:
    path = os.path.join(out_dir, 'mmr.png')
    heatmaps.mmr_heatmap(path, segments['core']['MMR_per_layer_pass'],
                         f'core MMR by layer and pass (step {s})')
    figures.append(path)
  return figures


def _masking(report: dict, run, params, batches: list, opts: _Options) -> list[dict]:
  """Per core layer, the traffic-matched masking test of its `opts.mask_top` most loaded
  experts (masking.py); none, and a note in not_applicable, without an MoE core."""
  masks = []
  if 'core' in report['segments'] and opts.mask_top > 0:
    cfg = run.model_cfg
    q = np.asarray(report['segments']['core']['load_share_pooled'])
    for d in range(cfg.core_layers):
      top = tuple(int(i) for i in np.argsort(-q[d], kind='stable')[:opts.mask_top])
      masks.append(masking.traffic_matched(cfg, params, batches, 'core', d, top, q[d],
                                           opts.mask_draws, opts.seed + d, report['loss'],
                                           runtime=run.runtime))
  elif opts.mask_top > 0 and 'core' not in report['segments']:
    report['not_applicable'].setdefault('masking', 'no MoE core layer to mask')
  return masks


def _timing(marks: tuple, tokens: int, records: dict) -> dict:
  """Seconds of loading, recording and masking from the times `marks` = (start, loaded,
  recorded, masked), per 1,000 probe tokens too, and of the records' first batch (with
  compilation) apart from the rest (`records`: probe_set.run's timing)."""
  t0, t1, t2, t3 = marks
  return {'load': t1 - t0, 'records': t2 - t1, 'masking': t3 - t2, 'total': t3 - t0,
          'records_per_1k_tokens': 1000 * (t2 - t1) / tokens,
          'total_per_1k_tokens': 1000 * (t3 - t0) / tokens,
          'records_first_batch': records['first_batch_s'],
          'records_per_1k_tokens_after_first_batch':
              1000 * records['rest_s'] / records['rest_tokens']
              if records['rest_tokens'] else None}


def _analyses(report: dict, run, params, batches: list, out_dir: str,
              opts: _Options) -> tuple[dict, list[str]]:
  """The optional analyses of the same checkpoint that `opts` asks for, each into its key of
  `report`: probes, evals, recurrence (with out_dir/recurrence.png). Returns the seconds of
  each that ran and the figures they wrote."""
  ran, figures = {}, []
  if opts.probes:
    t = time.perf_counter()
    report['probes'] = mech.mechanistic_probes(run.model_cfg, params,
                                               _probe_inputs(batches, opts.probes),
                                               runtime=run.runtime)
    ran['probes'] = time.perf_counter() - t
  if opts.evals:
    t = time.perf_counter()
    report['evals'] = ev.reasoning_evals(run, examples=opts.evals)
    ran['evals'] = time.perf_counter() - t
  if opts.recurrence:
    t = time.perf_counter()
    report['recurrence'] = ev.recurrence(run, opts.recurrence)
    figures.append(ev.plot_recurrence(report['recurrence'],
                                      os.path.join(out_dir, 'recurrence.png')))
    ran['recurrence'] = time.perf_counter() - t
  return ran, figures


def _probe_inputs(batches: list, tokens: int) -> list:
  """The probe set's own windows, whole batches until at least `tokens` tokens."""
  inputs, have = [], 0
  for b in batches:
    if have >= tokens:
      break
    inputs.append(b['inputs'])
    have += b['inputs'].size
  return inputs


def summary_lines(r: dict) -> list[str]:
  """A few printed lines: the headline figures and the timing."""
  lines = [f'step {r["step"]}: probe set {probe_set.describe(r["probe_set"])}; LM loss '
           f'{r["loss"]:.4f}']
  for what, why in r['not_applicable'].items():
    lines.append(f'not applicable: {what}: {why}')
  for seg, s in r['segments'].items():
    line = (f'{seg}: B2 pooled {_fmt(s["B2_pooled"])}  MaxVio {_fmt(s["MaxVio_global"])}  '
            f'MMR {s["MMR_overall"]:.3f}')
    if seg == 'core':
      line += (f'  U {s["U_mean"]:.2f} (normalised {s["U_normalized"]:.3f})  '
               f'B2 per pass {_fmt(s["B2_per_pass"])}  MMR per pass {_fmt(s["MMR_per_pass"])}')
    lines.append(line)
  for m in r['masking']:
    rd = m['random_delta_mean']
    lines.append(f'mask {m["segment"]} layer {m["layer"]} experts {m["experts"]} (traffic '
                 f'{m["traffic"]:.3f}): dloss {m["delta_loss"]:+.4f}; random matched sets '
                 f'(traffic {m["random_traffic_mean"] or 0:.3f}): '
                 + (f'{rd:+.4f} +- {m["random_delta_std"] or 0:.4f}' if rd is not None else 'none'))
  if 'probes' in r:
    p = r['probes']
    for n, sim in p.get('qkv_cosine', {}).items():
      lines.append(f'probes: {n} cosine between visits [layer][pass][pass]: {_fmt(sim)}')
    lines.append('probes: sink mass per segment/visit: '
                 + '  '.join(f'{k} {_fmt(v)}' for k, v in p['sink_mass'].items()))
  if 'evals' in r:
    e = r['evals']
    lines.append(f'evals ({e["num_loops"]} passes): Dyck by shots '
                 + json.dumps({k: _round(v) for k, v in _accuracies(e['dyck']).items()})
                 + '  tasks ' + json.dumps({k: _round(v) for k, v in
                                            _accuracies(e['tasks']).items()}))
  if 'recurrence' in r:
    rc = r['recurrence']
    lines.append('recurrence: val loss by passes '
                 + json.dumps({k: round(v, 4) for k, v in rc['val_loss'].items()}))
  t = r['timing_s']
  steady = t['records_per_1k_tokens_after_first_batch']
  lines.append(f'time: {t["total"]:.1f} s total ({t["total_per_1k_tokens"]:.3f} s per 1,000 '
               f'tokens; records {t["records"]:.1f} s = first batch {t["records_first_batch"]:.1f} '
               f's with compile, then '
               + (f'{steady:.3f} s per 1,000 tokens)' if steady is not None else 'no more batches)')
               + ''.join(f'; {name} {sec:.1f} s'
                         for name, sec in t.get('after_masking', {}).items()))
  return lines


def _accuracies(d: dict) -> dict:
  """{name: accuracy} of an evals dict whose values are accuracies or dicts holding one."""
  return {k: ((v.get('accuracy') if 'accuracy' in v else 'refused') if isinstance(v, dict)
              else v) for k, v in d.items()}


def _round(v):
  return round(v, 3) if isinstance(v, float) else v


def _fmt(x):
  return json.dumps(np.round(np.asarray(x, np.float64), 3).tolist())
