"""The SMELT replication (`reproduce.py smelt`): the SMELT law per architecture, the cell-paired
compute saving across the grid's compute range, and the probes of the compute-matched pair,
reported beside the paper's own figures (`PAPER`)."""
from __future__ import annotations

import os

import numpy as np

from loopmoe_jax.analysis import evals, probes
from loopmoe_jax.experiment import load_config
from loopmoe_jax.replicate import common
from loopmoe_jax.replicate.common import SMELT_RESAMPLES, _columns, _table
from loopmoe_jax.scaling import smelt_analysis

# The paper's figures: SMELT (arXiv 2609.01343v1), as quoted in the article "SMELT: looping
# wins even after you pay for the FLOPs".
# That source numbers no section for the scaling or probe results, so each comment names the
# part of the paper and, in quotes, the article's heading it is quoted under.
PAPER = {
    # scaling-law fit, one L = E + A (1-S)^b / F^a + K / D^c per architecture ("Does it
    # survive at scale"): capacity exponent a and data exponent c; E, A, b, K are not quoted
    'a': {'baseline': 0.3703, 'looped': 0.3892},
    'c': {'baseline': 0.6594, 'looped': 0.7011},
    # scaling-law fit: the frontier exponent gamma = a c / (a + c) ("Does it survive at scale")
    'gamma': {'baseline': 0.237, 'looped': 0.250},
    # compute efficiency, 1 - C_SMELT / C_baseline at matched loss, across the fitted compute
    # window, growing with compute; 95% intervals from 2,000 resamples of the twelve sparse
    # cells ("Does it survive at scale")
    'compute_efficiency': (0.068, 0.180), 'compute_window': (1.3e19, 2.2e21),
    'efficiency_cells': 12, 'efficiency_resamples': 2000,
    # compute-optimal split: 56-91 tokens per parameter depending on sparsity, SMELT within 6%
    # of the baseline at every sparsity level ("Does it survive at scale")
    'tokens_per_param': (56, 91), 'tokens_per_param_gap': 0.06,
    # mechanistic probe of the second visit through a shared layer: cosine between visits of
    # queries and keys 0.89-0.93, of values 0.65-0.74 ("Downstream, and where the second visit
    # spends its attention")
    'qk_cosine': (0.89, 0.93), 'v_cosine': (0.65, 0.74),
    # same probe: segment-start (sink) attention mass falls from 0.60 on the first visit to
    # 0.02 on the second, on a Dyck-language case study (same heading)
    'sink_mass': (0.60, 0.02),
    # in-context Dyck-language bracket matching at 32 shots: SMELT 29.8%, baseline 26.4%, the
    # gap widening with shot count (same heading)
    'dyck_shots': 32, 'dyck': {'baseline': 0.264, 'looped': 0.298},
    # the grid: 4 sizes (100M, 200M, 600M, 1.6B active) x 4 sparsity levels, three of them
    # sparse (S ~ 85%, 95%, 97%), all 16 cells in Appendix B ("Does it survive at scale")
    'sizes': '100M, 200M, 600M, 1.6B active', 'sparse_levels': (0.85, 0.95, 0.97),
}
ARCHS = (('baseline', 'baseline'), ('looped', 'smelt'))  # (ours, smelt_analysis.report's)


def run(out: str, scale: str, log=print) -> tuple[dict, str]:
  size = 'smoke' if scale == 'cpu' else '200m'
  steps = (50, 100, 200) if scale == 'cpu' else (2000, 4000, 8000)
  resamples = SMELT_RESAMPLES[scale]
  arch_rows, matched = {}, {}
  for variant in ('baseline', 'looped'):
    cfg = load_config(f'configs/smelt.py:{size},{variant}')
    cfg.train.sample_tokens, cfg.train.warmup = 0, 10
    if scale == 'gpu':
      cfg.data.source = 'embedded'
    width, experts = cfg.model.d_model, cfg.model.core_experts
    matched[variant] = (width, experts)
    # four cells per architecture (width x1, x1.5 by experts x1, x2: F and S vary), each at
    # three training lengths: the fewest that identify the SMELT law's six coefficients
    rows = common._sweep(cfg, {'model.d_model': [width, width * 3 // 2],
                        'model.core_experts': [experts, 2 * experts],
                        'train.steps': list(steps)}, os.path.join(out, variant), log)
    arch_rows[variant] = rows
  cols = {}
  for v, rows in arch_rows.items():
    # the cell of a row is its place in the grid (width and expert multipliers), the same
    # for both architectures: the paired bootstrap draws a cell's rows of both together
    w0, e0 = matched[v]
    cols[v] = {**_columns(rows), 'cell': np.array(
        [2.0 * (r['model.d_model'] != w0) + (r['model.core_experts'] != e0) for r in rows])}
  compute = float(max(np.max(c['C']) for c in cols.values()))
  rep = smelt_analysis.report(cols['baseline'], cols['looped'], compute, resamples=resamples)
  fits = {v: rep[name]['params'] for v, name in ARCHS}
  pair = {v: {int(r['steps']): r['loss'] for r in rows
              if (r['model.d_model'], r['model.core_experts']) == matched[v]}
          for v, rows in arch_rows.items()}
  points = [{'arch': v, 'width': int(r['model.d_model']), 'experts': int(r['model.core_experts']),
             'steps': int(r['steps']), 'F': int(r['F']), 'S': float(r['S']), 'C': float(r['C']),
             'loss': r['loss']} for v, rows in arch_rows.items() for r in rows]
  summary = {v: {k: rep[name][k]['value'] for k in ('gamma', 'F', 'D', 'tokens_per_param',
                                                    'loss')}
             | {k + '_ci': rep[name][k]['ci'] for k in ('gamma', 'tokens_per_param')}
             | {'S': rep[name]['S']}
             for v, name in ARCHS}
  eff, rng = rep['compute_efficiency'], rep['efficiency_range']
  eff_range = [{k: p[k] for k in ('at', 'compute', 'loss', 'value', 'ci')}
               for p in rng['points']]
  results = {'points': points, 'fits': fits, 'frontier': summary, 'compute': compute,
             'matched_loss': eff['loss'], 'compute_efficiency': eff['value'],
             'compute_efficiency_ci': eff['ci'], 'matched_pair': pair,
             'compute_efficiency_range': eff_range, 'compute_window': rng['window'],
             'efficiency_cells': rng['cells'], 'efficiency_sparsity': rng['sparsity'],
             'efficiency_resamples': rng['resamples'], 'paper': PAPER}
  pair_dirs = {v: next(r['workdir'] for r in rows if int(r['steps']) == max(steps) and
                       (r['model.d_model'], r['model.core_experts']) == matched[v])
               for v, rows in arch_rows.items()}
  results['analysis'] = analysis = smelt_probes(pair_dirs, log)
  results['probe_summary'] = probe = probe_summary(analysis)
  report = _report(scale, size, steps, resamples, results, probe, smelt_probe_report(analysis))
  return results, report


def _span(x) -> str:
  return 'n/a' if x is None else f'{x[0]:.3g}-{x[1]:.3g}'


def _ci(x) -> str:
  return f'[{x[0]:.3g}, {x[1]:.3g}]'


def _pct(x) -> str:
  return f'[{x[0]:.1%}, {x[1]:.1%}]'


def _report(scale, size, steps, resamples, res, probe, probe_text) -> str:
  """report.md's text: ours beside the paper's figures, the shortcuts taken, the runs, the
  fitted laws, the frontier and the saving, then the probes' section (`probe_text`)."""
  return '\n\n'.join((_report_intro(scale, size, steps, res), _report_paper(res, probe),
                      _report_shortcuts(size, steps, resamples, res), _report_runs(res),
                      _report_frontier(resamples, res), probe_text))


def _report_intro(scale, size, steps, res) -> str:
  """The title and what was trained, marked as a different scale from the paper's."""
  lengths, window = list(steps), res['compute_window']
  return f"""# SMELT, mini-replication ({scale} scale)

Each architecture of `configs/smelt.py:{size},baseline|looped` (the twin loops the middle half
twice with 1/r scaling) in four cells (1x and 1.5x the width by 1x and 2x the experts; the
first is the compute-matched pair) at training lengths {lengths}, one data order. **Different scale
from the paper** ({PAPER['sizes']} models over 1.3e19-2.2e21 training FLOPs; ours
{window[0]:.3g}-{window[1]:.3g}): read the pipeline, not the
constants."""


def _report_paper(res, probe) -> str:
  """The table of our figures beside the paper's, with where each side comes from."""
  rows = _paper_fit_rows(res) + _paper_probe_rows(res, probe)
  return f"""## Ours beside the paper's figures

{_table(rows, ['figure', 'ours', 'paper'])}

The paper's figures are quoted from SMELT (arXiv 2609.01343) as `PAPER` in
`loopmoe_jax/replicate/smelt.py`; ours come from the runs below. This table compares numbers;
the run tests none of the paper's claims at the paper's scale."""


def _paper_fit_rows(res) -> list[dict]:
  """Rows of the paper table from the fitted laws: a, c, gamma and tokens per parameter per
  architecture."""
  fits, summary = res['fits'], res['frontier']
  return [
      {'figure': f'{k} ({v})', 'ours': f'{fits[v][k]:.4g}', 'paper': f'{PAPER[k][v]:.4g}'}
      for k in ('a', 'c') for v in ('baseline', 'looped')] + [
      {'figure': f'gamma ({v})', 'ours': f"{summary[v]['gamma']:.3g} "
       f"{_ci(summary[v]['gamma_ci'])}", 'paper': f"{PAPER['gamma'][v]:.3g}"}
      for v in ('baseline', 'looped')] + [
      {'figure': f'tokens per parameter ({v})', 'ours': f"{summary[v]['tokens_per_param']:.3g} "
       f"{_ci(summary[v]['tokens_per_param_ci'])} at C={res['compute']:.3g}",
       'paper': '56-91 by sparsity, SMELT within 6% of baseline'} for v in ('baseline', 'looped')
  ]


def _paper_probe_rows(res, probe) -> list[dict]:
  """Rows of the paper table from the saving across compute and from the probes: Q/K/V
  cosine and sink mass between visits, and Dyck accuracy per architecture."""
  ours_eff = {p['at']: p for p in res['compute_efficiency_range']}
  lo, hi = ours_eff['min compute'], ours_eff['max compute']
  dyck = probe['dyck']
  v1, v2 = probe['sink'] or (None, None)
  return [
      {'figure': 'compute saving at matched loss, min -> max compute',
       'ours': f"{lo['value']:.1%} {_pct(lo['ci'])} -> {hi['value']:.1%} {_pct(hi['ci'])}, "
               f"C {res['compute_window'][0]:.3g}-{res['compute_window'][1]:.3g}",
       'paper': '6.8% -> 18.0%, C 1.3e19-2.2e21'},
      {'figure': 'Q, K cosine between visits (looped)',
       'ours': f"q {_span(probe['q'])}, k {_span(probe['k'])}", 'paper': '0.89-0.93'},
      {'figure': 'V cosine between visits (looped)', 'ours': _span(probe['v']),
       'paper': '0.65-0.74'},
      {'figure': 'sink mass, visit 1 -> visit 2 (looped)',
       'ours': 'n/a' if v1 is None else f'{v1:.3f} -> {v2:.3f} (probe tokens)',
       'paper': '0.60 -> 0.02 (Dyck case study)'}] + [
      {'figure': f'Dyck accuracy ({v})', 'ours': dyck[v],
       'paper': f"{PAPER['dyck'][v]:.1%} at 32 shots"} for v in ('baseline', 'looped')]


def _report_shortcuts(size, steps, resamples, res) -> str:
  """Every way this run departs from the paper's protocol."""
  s_b, s_n = res['efficiency_sparsity']
  levels = {v: sorted({round(p['S'], 3) for p in res['points'] if p['arch'] == v})
            for v in ('baseline', 'looped')}
  return f"""## Shortcuts this run took

- Scale: `{size}` models trained {min(steps)}-{max(steps)} steps, one data order per point;
  the paper: 4 sizes ({PAPER['sizes']}) over 1.3e19-2.2e21 training FLOPs.
- Grid: 4 cells per architecture x {len(steps)} lengths = {len(steps) * 4} points for the
  law's 6 coefficients; sparsities {levels['baseline']} (baseline) and {levels['looped']}
  (looped), set by the expert count, not the paper's 85/95/97%. The paper: 12 sparse cells.
- Fit: all six coefficients fitted, none fixed (Huber on log-loss, `scaling/fitting.py`).
- Intervals: {resamples} cell-bootstrap resamples (the paper: 2,000); the saving's from one
  cell-paired bootstrap over our {res['efficiency_cells']} paired cells (the paper: 12),
  read at the median sparsity of each grid (baseline {s_b:.3g}, looped {s_n:.3g}; the paper
  does not say at which), per training length at the geometric mean of the baseline's compute.
- Tokens per parameter at our largest compute and median sparsity, not per sparsity level.
- Probes: only the compute-matched pair's longest run; Q/K/V cosine and sink mass (attention
  on position 0, mean over the shared layers) on validation tokens, not on a Dyck case study;
  Dyck-2 on 32 queries, teacher-forced argmax, at the shot counts the context admits."""


def _report_runs(res) -> str:
  """The trained points, the compute-matched pair's losses and the law fitted per
  architecture."""
  fits, pair = res['fits'], res['matched_pair']
  pair_rows = [{'steps': s, 'baseline': pair['baseline'][s], 'looped': pair['looped'][s]}
               for s in sorted(pair['baseline'])]
  return f"""## Points

{_table(res['points'], ['arch', 'width', 'experts', 'steps', 'F', 'S', 'C', 'loss'])}

## The compute-matched pair

{_table(pair_rows, ['steps', 'baseline', 'looped'])}

## SMELT law per architecture, L = E + A (1-S)^b / F^a + K / D^c

{_table([{'arch': v, **fits[v]} for v in fits], ['arch', 'E', 'A', 'b', 'a', 'K', 'c'])}"""


def _report_frontier(resamples, res) -> str:
  """The compute-optimal frontier per architecture, the saving at its matched loss and the
  saving across the grid's compute range."""
  summary, compute, ci = res['frontier'], res['compute'], res['compute_efficiency_ci']
  frontier_rows = [{'arch': v, **{k: summary[v][k] for k in ('S', 'gamma', 'F', 'D',
                                                             'tokens_per_param', 'loss')},
                    'gamma 95%': _ci(summary[v]['gamma_ci'])} for v in summary]
  eff_rows = [{'at': p['at'], 'C': p['compute'], 'matched loss': p['loss'],
               'saving': f"{p['value']:.1%}", '95%': _pct(p['ci'])}
              for p in res['compute_efficiency_range']]
  heading = f'Compute-optimal frontier at C = {compute:.3g} FLOPs'
  return f"""## {heading} (cell bootstrap, {resamples} resamples)

{_table(frontier_rows, ['arch', 'S', 'gamma', 'gamma 95%', 'F', 'D', 'tokens_per_param', 'loss'])}

At the baseline frontier's loss at this compute ({res['matched_loss']:.4f}) the looped frontier
needs **{res['compute_efficiency']:.1%}** less training compute (95% interval
{ci[0]:.1%} to {ci[1]:.1%}; negative: it
costs more).

## Compute saving across the grid's compute range (cell-paired bootstrap)

{_table(eff_rows, ['at', 'C', 'matched loss', 'saving', '95%'])}

Each resample draws the {res['efficiency_cells']} paired sparse cells with replacement, refits
both laws on both architectures' rows of the drawn cells and reads 1 - C_looped / C at the
baseline frontier's loss at C. Paper: 6.8% to 18.0% over 1.3e19-2.2e21 FLOPs."""



def smelt_probes(pair_dirs: dict[str, str], log=print, tokens: int = 4096) -> dict:
  """SMELT's probes and in-context eval of the compute-matched pair (`pair_dirs`:
  {'baseline', 'looped'} run directories): Q/K/V cosine between the twin's visits, sink mass
  per visit, and Dyck-2 exact match by shots (analysis/probes.py, analysis/evals.py)."""
  out = {}
  for v, workdir in pair_dirs.items():
    log(f'smelt: probes and Dyck of {workdir}')
    out[v] = {'workdir': workdir, 'probes': probes.probe_workdir(workdir, tokens),
              'dyck': evals.reasoning_evals(workdir, examples=32)['dyck']}
  return out


def probe_summary(analysis: dict) -> dict:
  """The looped model's figures the paper quotes: per projection ('q', 'k', 'v') the range
  over shared layers of the cosine between visits 1 and 2 (None when not probed), the sink
  mass of the core on visits 1 and 2 averaged over the shared layers, and per architecture
  its Dyck accuracy at the most shots the context admitted ('n/a' when none)."""
  looped = analysis.get('looped', {}).get('probes', {})
  out = {}
  for n in ('q', 'k', 'v'):
    sim = np.asarray(looped.get('qkv_cosine', {}).get(n, []), float)
    ok = sim.ndim == 3 and sim.shape[-1] >= 2
    out[n] = (float(sim[:, 0, 1].min()), float(sim[:, 0, 1].max())) if ok else None
  core = np.asarray(looped.get('sink_mass', {}).get('core', []), float)
  ok = core.ndim == 2 and core.shape[1] >= 2
  out['sink'] = (float(core[:, 0].mean()), float(core[:, 1].mean())) if ok else None
  out['dyck'] = {}
  for v, a in analysis.items():
    scored = sorted((int(k), d['accuracy']) for k, d in a['dyck'].items() if 'accuracy' in d)
    out['dyck'][v] = f'{scored[-1][1]:.1%} at {scored[-1][0]} shots' if scored else 'n/a'
  return out


def smelt_probe_report(analysis: dict) -> str:
  rows = []
  for v, a in analysis.items():
    for n, sim in a['probes'].get('qkv_cosine', {}).items():
      sim = np.asarray(sim)  # [D][L][L]: visit 1 against visit 2 per shared layer
      if sim.shape[-1] < 2:  # one pass: no second visit to compare
        continue
      rows.append({'arch': v, 'probe': f'{n} cosine, visits 1-2',
                   'per layer': ', '.join(f'{x:.3f}' for x in sim[:, 0, 1])})
    for seg, mass in a['probes']['sink_mass'].items():
      rows.append({'arch': v, 'probe': f'sink mass, {seg}',
                   'per layer': ', '.join(f'{x:.3f}' for x in np.ravel(mass))})
  dyck = [{'arch': v, **{f'{k}-shot': (d['accuracy'] if 'accuracy' in d else 'refused')
                          for k, d in a['dyck'].items()}} for v, a in analysis.items()]
  shots = [k for k in dyck[0] if k != 'arch']
  return f"""## Probes and in-context Dyck of the compute-matched pair (longest run)

{_table(rows, ['arch', 'probe', 'per layer'])}

Core sink mass is listed per shared layer, visit by visit ([layer][visit] flattened).

Dyck-2 completion, exact match of the closing sequence (teacher-forced argmax, 32 queries;
'refused': the prompts exceed the trained context):

{_table(dyck, ['arch'] + shots)}

Paper (second visit through a shared layer): queries and keys stay close to the first visit's
(cosine {PAPER['qk_cosine'][0]}-{PAPER['qk_cosine'][1]}) while values diverge more
({PAPER['v_cosine'][0]}-{PAPER['v_cosine'][1]}); the segment-start sink mass falls from
{PAPER['sink_mass'][0]:.2f} to {PAPER['sink_mass'][1]:.2f} on a Dyck-language case study; at
{PAPER['dyck_shots']} shots Dyck accuracy is {PAPER['dyck']['looped']:.1%} (SMELT) against
{PAPER['dyck']['baseline']:.1%} (baseline), the gap widening with shots. The paper's models
are {PAPER['sizes']}; the tables above test none of it at that scale.
"""
