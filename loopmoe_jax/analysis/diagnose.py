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

import json
import os
import time

import numpy as np

from loopmoe_jax.analysis import diagnostics, heatmaps, masking, probe_set
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
  for name, value in dict(tokens=tokens, mask_top=mask_top, mask_draws=mask_draws, probes=probes,
                          evals=evals, recurrence=recurrence).items():
    if value < 0 or (name == 'tokens' and value == 0):
      raise ValueError(f'--{name}={value}: must be {"> 0" if name == "tokens" else ">= 0"}')
  t0 = time.perf_counter()
  run = RunDir(workdir).load(step)  # read once: the evals and recurrence below reuse it
  cfg, params, s, config = run.model_cfg, run.variables, run.step, run.config
  if cfg.core_experts and mask_top > cfg.core_experts - cfg.top_k:
    raise ValueError(f'--mask_top={mask_top}: must be <= model.core_experts - model.top_k = '
                     f'{cfg.core_experts - cfg.top_k} (a token needs top_k unmasked experts)')
  batches, info = probe_set.probe_batches(config['data'], cfg, tokens)
  info['setting'] = chosen
  experts = probe_set.segment_experts(cfg)
  log(f'probe set: {probe_set.describe(info)}')
  t1 = time.perf_counter()
  res = probe_set.run(cfg, params, batches, record=bool(experts), tokens=info['tokens'],
                      runtime=run.runtime)
  t2 = time.perf_counter()
  report = {'workdir': workdir, 'step': s, 'probe_set': info, 'loss': res['loss'],
            'not_applicable': not_applicable(cfg), 'segments': {}}
  routing = res.get('routing', {})
  for seg in probe_set.SEGMENTS:
    if seg in routing:
      report['segments'][seg] = segment_report(seg, routing[seg], experts[seg][1],
                                               info['batch_tokens'])
  os.makedirs(out_dir, exist_ok=True)
  figures = []
  if report['segments']:
    shares = {seg: (r['load_share_per_pass'] if seg == 'core' else
                    np.asarray(r['load_share_pooled'])[:, None, :])
              for seg, r in report['segments'].items()}
    path = os.path.join(out_dir, 'expert_load.png')
    heatmaps.load_heatmap(path, shares, f'expert load share by layer and pass (step {s}, '
                          f'{info["tokens"]} tokens)')
    figures.append(path)
  if 'core' in report['segments']:
    path = os.path.join(out_dir, 'mmr.png')
    heatmaps.mmr_heatmap(path, report['segments']['core']['MMR_per_layer_pass'],
                         f'core MMR by layer and pass (step {s})')
    figures.append(path)
  masks = []
  if 'core' in report['segments'] and mask_top > 0:
    q = np.asarray(report['segments']['core']['load_share_pooled'])
    for d in range(cfg.core_layers):
      top = tuple(int(i) for i in np.argsort(-q[d], kind='stable')[:mask_top])
      masks.append(masking.traffic_matched(cfg, params, batches, 'core', d, top, q[d],
                                           mask_draws, seed + d, res['loss'], run.runtime))
  elif mask_top > 0 and 'core' not in report['segments']:
    report['not_applicable'].setdefault('masking', 'no MoE core layer to mask')
  report['masking'] = masks
  t3 = time.perf_counter()
  report['timing_s'] = {'load': t1 - t0, 'records': t2 - t1, 'masking': t3 - t2,
                        'total': t3 - t0,
                        'records_per_1k_tokens': 1000 * (t2 - t1) / info['tokens'],
                        'total_per_1k_tokens': 1000 * (t3 - t0) / info['tokens'],
                        'records_first_batch': res['timing']['first_batch_s'],
                        'records_per_1k_tokens_after_first_batch':
                            1000 * res['timing']['rest_s'] / res['timing']['rest_tokens']
                            if res['timing']['rest_tokens'] else None}
  ran = {}  # seconds of each analysis after masking that ran
  if probes:
    t = time.perf_counter()
    from loopmoe_jax.analysis import probes as mech  # pylint: disable=import-outside-toplevel
    inputs, have = [], 0  # the probe set's own windows, up to `probes` tokens
    for b in batches:
      if have >= probes:
        break
      inputs.append(b['inputs'])
      have += b['inputs'].size
    report['probes'] = mech.mechanistic_probes(cfg, params, inputs)
    ran['probes'] = time.perf_counter() - t
  if evals:
    t = time.perf_counter()
    from loopmoe_jax.analysis import evals as ev  # pylint: disable=import-outside-toplevel
    report['evals'] = ev.reasoning_evals(run, examples=evals)
    ran['evals'] = time.perf_counter() - t
  if recurrence:
    t = time.perf_counter()
    from loopmoe_jax.analysis import evals as ev  # pylint: disable=import-outside-toplevel
    report['recurrence'] = ev.recurrence(run, recurrence)
    figures.append(ev.plot_recurrence(report['recurrence'],
                                      os.path.join(out_dir, 'recurrence.png')))
    ran['recurrence'] = time.perf_counter() - t
  report['timing_s']['analyses_after_masking'] = time.perf_counter() - t3
  report['timing_s']['after_masking'] = ran  # only the analyses that ran
  report['figures'] = figures
  report = _plain(report)
  with open(os.path.join(out_dir, 'diagnostics.json'), 'w') as f:
    json.dump(report, f, indent=1)
  return report


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
    lines.append(f'probes: sink mass per segment/visit: '
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
