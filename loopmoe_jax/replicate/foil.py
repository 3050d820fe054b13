"""The Foil replication (`reproduce.py foil`): "How to Loop MoE: Flatten the Experts, Untie the
Attention" -- flattening at equal parameters and compute (its Figure 3) with one of its
tied-attention controls (Table 3) -- at a much smaller scale.

Trains Base (8,8,2), Foil-3 (16,4,4), Foil-2 (32,2,8), Foil-1 (64,1,16) -- each with per-pass
attention -- and Base-tied (Base with one attention set shared by its passes) from
configs/foil.py, one seed and one data order. Pairs each model against Base, and each untied
model against Base-tied, over every step of the final window (train.final_window, the
trainer's final_steps.jsonl; analysis/paired.py, as scripts/compare.py's default), the
paper's protocol (its last 2,000 steps). Routing diagnostics of each final checkpoint
(analysis/diagnose.py). The report puts the paper's figures (PAPER) beside ours and lists
every shortcut taken.
"""
from __future__ import annotations

import os

import numpy as np

from loopmoe_jax.accounting import count
from loopmoe_jax.analysis import paired, probe_set
from loopmoe_jax.analysis.diagnose import diagnose
from loopmoe_jax.config import ModelConfig
from loopmoe_jax.experiment import load_config
from loopmoe_jax.replicate import common
from loopmoe_jax.replicate.common import _mean, _table
from loopmoe_jax.train.run import RunDir

UNTIED = ('base', 'foil3', 'foil2', 'foil1')
TIED = 'base_tied'  # Base's tied-attention control (configs/foil.py)
VARIANTS = UNTIED + (TIED,)
STEPS = {'cpu': 150, 'gpu': 3000}
# The paired window, every step of it recorded: at cpu scale the smoke config's own 50 (a
# third of the run), at gpu scale the last 300 steps (the WSD decay, as the paper's 2,000 lie
# in its 5,000-step decay).
FINAL_WINDOW = {'cpu': 50, 'gpu': 300}
PROBE_TOKENS = {'cpu': 4096, 'gpu': None}  # None: diagnose's gpu default, Foil's 255,500
MASK_DRAWS = 2
PAIRED_KEYS = ('mean_diff', 'se', 'lag1_autocorr', 'n_eff', 'se_eff', 'n')

# Foil's own figures, quoted from the paper. Paired final-window loss differences against
# Base (Figure 3): Foil-1 -0.007 nat at 20B tokens, -0.012 at 100B; at 20B all three Foils are
# below Base, Foil-2 slightly below Foil-1. Mean distinct experts per token U at 20B (Sec.
# 2.3's count, Table 10). The MMR difference between Foil and proto-Foil (untied vs tied
# attention) is largest for the Foil-2 pair, 14% (Sec. 3.2, Figure 4 c2). Parameters (Table
# 3): Base and every Foil 553.7M, Base-tied 520.2M, proto-Foil-1 490.8M. Base-tied's seed
# replicate differs by -0.0003 +- 0.0009 nat, and differences below 0.002 nat are read as on
# par (Table 4's seed paragraph). Window: the last 2,000 of 50,000 steps; probe set 255,500
# tokens (the routing diagnostics, Sec. 2.3).
PAPER = {
    'paired_diff_vs_base': {'foil1': {'20B': -0.007, '100B': -0.012}},
    'U_mean_20B': {'base': 24.1, 'foil3': 17.8, 'foil2': 12.5, 'foil1': 9.7},
    'mmr_gap_untied_vs_tied': {'pair': 'foil2 vs protofoil2', 'relative': 0.14},
    'params_M': {'base': 553.7, 'foil3': 553.7, 'foil2': 553.7, 'foil1': 553.7,
                 'base_tied': 520.2, 'protofoil1': 490.8},
    'seed_replicate_diff': {'variant': 'base_tied', 'mean_diff': -0.0003, 'se': 0.0009},
    'on_par_below': 0.002,
    'final_window_steps': 2000, 'steps': 50_000, 'probe_tokens': 255_500,
}
PAPER_GAP_TEXT = {'base': 'reference', 'foil3': '< 0 (20B)',
                  'foil2': '< -0.007 (20B)', 'foil1': '-0.007 (20B), -0.012 (100B)',
                  TIED: 'not quoted'}


def config(variant: str, scale: str):
  """The experiment config of one variant at `scale` (what the sweep trains)."""
  cfg = load_config(f'configs/foil.py:{variant}' + (',smoke' if scale == 'cpu' else ''))
  steps = STEPS[scale]
  cfg.train.steps, cfg.train.sample_tokens, cfg.train.log_every = steps, 0, 1
  cfg.train.routing_every, cfg.train.eval_every = steps // 3, steps
  cfg.train.final_window = FINAL_WINDOW[scale]
  if scale == 'gpu':
    cfg.data.source = 'embedded'
  return cfg


def window_steps(workdir: str, steps: int, window: int) -> list[int]:
  """The steps of the run's final window, each checked present in its final_steps.jsonl."""
  want = list(range(steps - window + 1, steps + 1))
  missing = sorted(set(want) - set(RunDir(workdir).final_steps()))
  if missing:
    raise ValueError(f'{workdir}: final_steps.jsonl lacks {len(missing)} of the {window} steps '
                     f'of its final window ({want[0]}..{want[-1]}, e.g. {missing[:3]}): a run '
                     'trained before the trainer kept that record; remove it to retrain')
  return want


def pair(dir_a: str, dir_b: str, window: list[int]) -> dict:
  """A - B paired over every step of the final window (paired.compare_runs' default)."""
  c = paired.compare_runs(dir_a, dir_b)
  if c['window_steps'] != [window[0], window[-1]] or c['n'] != len(window):
    raise ValueError(f'{dir_a} vs {dir_b}: paired over steps {c["window_steps"]} ({c["n"]}, '
                     f'{c["window_source"]}), not the final window {window[0]}..{window[-1]}')
  return {k: c[k] for k in PAIRED_KEYS}


def routing_diagnostics(workdir: str, out_dir: str, scale: str, log=print) -> dict:
  return diagnose(workdir, out_dir, tokens=PROBE_TOKENS[scale], mask_draws=MASK_DRAWS, log=log,
                  scale=scale)


def reading(a: str, b: str, m: float, se_eff: float) -> str:
  """The paired difference m = A - B in words, with the paper's on-par threshold."""
  z = abs(m) / se_eff if se_eff > 0 else float('inf')
  if abs(m) < PAPER['on_par_below']:
    return f'on par (|diff| < {PAPER["on_par_below"]} nat, the paper\'s threshold)'
  lower = f'{a if m < 0 else b} lower by {abs(m):.4f} nat ({z:.1f} SE_eff)'
  return lower if z >= 2 else lower + ', within 2 SE_eff: not resolved'


def run(out: str, scale: str, log=print) -> tuple[dict, str]:
  steps, fw = STEPS[scale], FINAL_WINDOW[scale]
  results, dirs, windows, probe = {}, {}, {}, None
  for v in VARIANTS:
    cfg = config(v, scale)
    (row,) = common._sweep(cfg, {'train.steps': [steps]}, os.path.join(out, v), log)
    mc = ModelConfig.from_dict(cfg.model)
    run_dir = RunDir(row['workdir'])
    summary, routing = run_dir.summary(), run_dir.routing()
    last = max(r['step'] for r in routing)
    by_pass = {}
    for r in routing:
      if r['step'] == last and r['segment'] == 'core':
        by_pass.setdefault(r['pass'], []).append(r['max_vio'])
    results[v] = {'shape': f'{mc.core_experts}x{mc.core_layers}x{mc.num_loops}',
                  'tie_attention': bool(mc.tie_attention),
                  'params': count(mc)['params_total'], 'val_loss': summary['val_loss'],
                  'final_window_loss': summary['final_window_loss'],
                  'max_vio_by_pass': {p: float(np.mean(x)) for p, x in sorted(by_pass.items())}}
    dirs[v] = row['workdir']
    windows[v] = window_steps(row['workdir'], steps, fw)
    log(f'foil: routing diagnostics of {v}')
    diag = routing_diagnostics(row['workdir'], os.path.join(out, 'diagnostics', v), scale, log)
    probe = diag['probe_set']
    core = diag['segments'].get('core', {})
    results[v]['diagnostics'] = {k: core.get(k) for k in (
        'U_mean', 'U_normalized', 'B2_pooled', 'B2_per_pass', 'MaxVio_global', 'MMR_overall',
        'MMR_per_pass')}
  win = windows['base']
  for v in VARIANTS[1:]:
    results[v]['paired_diff_vs_base'] = pair(dirs[v], dirs['base'], win)
  for v in UNTIED:
    results[v]['paired_diff_vs_base_tied'] = pair(dirs[v], dirs[TIED], win)
  mmr = {v: results[v]['diagnostics']['MMR_overall'] for v in ('base', TIED)}
  results['mmr_gap_untied_vs_tied'] = {
      'pair': f'base vs {TIED}', 'relative': mmr['base'] / mmr[TIED] - 1
      if mmr['base'] and mmr[TIED] else None}
  results['paired_window'] = {'steps': [win[0], win[-1]], 'n': len(win), 'train_steps': steps,
                              'source': 'final_steps.jsonl (every step of the final window)'}
  results['probe_set'] = probe
  results['paper'] = PAPER
  probe_text = probe_set.describe({**probe, 'setting': ''}) + (
      " (this pipeline's small cpu probe set)" if PROBE_TOKENS[scale] else
      " (diagnose's --scale=gpu default, Foil's count)")
  return results, report(results, scale, config('base', scale), probe_text)


def report(results: dict, scale: str, cfg, probe_text: str) -> str:
  """report.md's text: the shortcuts and each variant's losses and paired difference against
  Base, the untied models against Base-tied, and the routing diagnostics, each beside the
  paper's figures."""
  return '\n\n'.join((_report_losses(results, scale, cfg, probe_text),
                      _report_tied(results), _report_routing(results)))


def _shortcuts(results: dict, scale: str, cfg, probe_text: str) -> str:
  """Every way this run departs from the paper's protocol, one bullet each."""
  steps, win = results['paired_window']['train_steps'], results['paired_window']
  d, m = cfg.data, cfg.model
  return '\n'.join('- ' + x for x in (
      f"scale: {'smoke' if scale == 'cpu' else 'full'} widths (d_model {m.d_model}, expert width "
      f"{m.expert_width}), {results['base']['params']:,} parameters in Base against 553.7M;",
      f'training: {steps} steps of {d.batch_size} x {d.seq_len} tokens '
      f'({steps * d.batch_size * d.seq_len:,}) of the `{d.source}` corpus ({d.tokenizer} '
      'tokenizer), against 50,000 steps of 96 x 4,096 (19.66B tokens of FineWeb-Edu);',
      f'one seed ({cfg.train.seed}) and no seed replicate (the paper\'s Base-tied replicate '
      'differs by -0.0003 +- 0.0009 nat);',
      f"paired window: every step of the final window, steps {win['steps'][0]}.."
      f"{win['steps'][1]} ({win['n']} steps, each run's final_steps.jsonl), against the last "
      '2,000 of 50,000;',
      f"probe set: {probe_text}, against the paper's 255,500 probe tokens; masking test with "
      f'{MASK_DRAWS} random traffic-matched draws per layer;',
      'tied controls: Base-tied alone; proto-Foil-3/2/1 are not trained.'))


def _report_losses(results: dict, scale: str, cfg, probe_text: str) -> str:
  """The title, the shortcuts, and per variant its losses, parameters and paired difference
  against Base beside the paper's (Figure 3, Table 3)."""
  rows = [{'variant': v, **{k: results[v][k] for k in ('shape', 'params', 'val_loss',
                                                       'final_window_loss')},
           'attention': 'tied' if results[v]['tie_attention'] else 'per pass',
           'paper params': f"{PAPER['params_M'][v]}M",
           'paired_diff': results[v].get('paired_diff_vs_base', {}).get('mean_diff', 0.0),
           'se_eff': results[v].get('paired_diff_vs_base', {}).get('se_eff', 0.0),
           'paper paired_diff': PAPER_GAP_TEXT[v],
           'max_vio_pass0': results[v]['max_vio_by_pass'].get(0, float('nan'))}
          for v in VARIANTS]
  return f"""# Foil, mini-replication ({scale} scale)

The looped-block shapes (E, D, L) of `configs/foil.py` with per-pass attention, and Base's
tied-attention control Base-tied, trained on one data order with one seed. **Different scale
from the paper**: read the pipeline, not the constants. Shortcuts against the paper:

{_shortcuts(results, scale, cfg, probe_text)}

{_table(rows, ['variant', 'shape', 'attention', 'params', 'paper params', 'val_loss',
               'final_window_loss', 'paired_diff', 'se_eff', 'paper paired_diff',
               'max_vio_pass0'])}

`paired_diff`: mean over the final window of (variant loss - Base loss) at the same step on
the same batch (negative: better than Base), `se_eff` its standard error with the
lag-1-autocorrelation effective sample size (analysis/paired.py). `paper paired_diff`: Foil's
Figure 3: Foil-1 ends 0.007 nat below Base at 20B tokens and 0.012 at 100B; at 20B
all three Foils are below Base, Foil-2 slightly below Foil-1 (no figure quoted for Foil-2/3).
MaxVio of the core's first pass at the last routing record."""


def _report_tied(results: dict) -> str:
  """Each untied model against Base-tied, read with the paper's on-par threshold, and what
  the one tied pair trained here can and cannot test."""
  tied_rows = [{'A - B': f'{v} - {TIED}', 'paired_diff': p['mean_diff'], 'se_eff': p['se_eff'],
                'n': p['n'], 'reading': reading(v, TIED, p['mean_diff'], p['se_eff'])}
               for v in UNTIED for p in [results[v]['paired_diff_vs_base_tied']]]
  return f"""## Tied attention (Base-tied)

Each untied model against Base-tied, paired over the same window (Base-tied against Base is
in the table above; `reading`: the paper reads |diff| < 0.002 nat as on par):

{_table(tied_rows, ['A - B', 'paired_diff', 'se_eff', 'n', 'reading'])}

The paper (Table 3) compares tied and untied attention at each of its four shapes
(Base-tied and proto-Foil-3/2/1 against Base and Foil-3/2/1). This run has one of those pairs,
at Base's shape: it tests whether per-pass attention changes the loss at Base's shape and
whether the Foils beat Base-tied, at this scale and seed. It does not test whether flattening
helps with tied attention (the proto-Foils), so it says nothing on that."""


def _report_routing(results: dict) -> str:
  """The routing diagnostics per variant beside the paper's U (Table 10), and the MMR gap
  between untied and tied attention at Base's shape."""
  diag_rows = [{'variant': v, 'U': d['U_mean'], 'paper U (20B)': PAPER['U_mean_20B'].get(v, '-'),
                'U_norm': d['U_normalized'], 'B2_pooled': _mean(d['B2_pooled']),
                'B2_per_pass': _mean(d['B2_per_pass']), 'MaxVio': _mean(d['MaxVio_global']),
                'MMR': d['MMR_overall']}
               for v in VARIANTS for d in [results[v]['diagnostics']]]
  gap = results['mmr_gap_untied_vs_tied']['relative']
  gap_text = f'{gap:+.1%}' if gap is not None else 'n/a'
  return f"""## Routing diagnostics

Final checkpoints over the probe set (analysis/diagnose.py; core layers, means over layers
and passes; per-run JSON and heatmaps under `diagnostics/`). `paper U (20B)`: Foil's Table 10
(Sec. 2.3).

{_table(diag_rows, ['variant', 'U', 'paper U (20B)', 'U_norm', 'B2_pooled', 'B2_per_pass',
                    'MaxVio', 'MMR'])}

MMR, untied against tied at Base's shape (MMR_Base / MMR_Base-tied - 1): {gap_text}. Paper
(Sec. 3.2, Figure 4 c2): the Foil vs proto-Foil MMR difference is largest for the Foil-2 pair,
14%; the Base pair's is not quoted, and the Foil-2 pair is not trained here, so the two are
not compared.
"""
