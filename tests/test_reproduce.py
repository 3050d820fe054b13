"""scripts/reproduce.py's analyses on rows from known laws (the training runs stubbed: the
real CPU runs are the script's job, quoted in the closing notes)."""
import json
import os

import numpy as np
import pytest

from loopmoe_jax import replicate as reproduce
from loopmoe_jax.scaling import from_params


def _loop_law_rows(truth, grid, noise=0.0, seed=0):
  """Sweep rows over the replication's grid with losses from `truth` (sizes from d_model)."""
  rng = np.random.default_rng(seed)
  rows = []
  for w in grid['model.d_model']:
    for s in grid['train.steps']:
      for r in grid['model.num_loops']:
        for e in grid['model.core_experts']:
          n = 6e3 * w ** 1.5
          row = {'point': f'w={w},s={s},r={r},E={e}', 'model.d_model': w, 'N_active_pass': n,
                 'N_block_active': n / 2, 'N_stored': n + 2e3 * e, 'D': s * 1024.0,
                 'C': 6 * (n + (r - 1) * n / 2) * s * 1024.0, 'r': float(r), 'E': float(e),
                 'k': 2.0, 'steps': s}
          row['loss'] = float(truth.predict({k: np.atleast_1d(v) for k, v in row.items()
                                             if k != 'point'})[0])
          row['loss'] *= float(np.exp(noise * rng.standard_normal()))
          rows.append(row)
  return rows


def test_loop_laws_report_ranks_the_generating_form(tmp_path, monkeypatch):
  truth = from_params('loop_sparse_bounded', {'A': 400.0, 'B': 1500.0, 'E': 1.8,
                                              'alpha': 0.34, 'beta': 0.36, 'delta_e': 0.1,
                                              'gamma0': 1.0, 'beta0': 0.8, 'delta': 0.3})
  monkeypatch.setattr(reproduce.common, '_sweep',
                      lambda cfg, grid, out, log: _loop_law_rows(truth, grid))
  res = reproduce.run('loop_laws', str(tmp_path), 'cpu', log=lambda *_: None)
  assert res['points'] == 54
  assert res['best_form'] == 'loop_sparse_bounded' and res['distinguishable']
  # held out on every axis: passes, experts and the largest size
  assert set(res['heldout']['loop_linear']) == {'r', 'E', 'model.d_model'}
  assert max(res['heldout']['loop_sparse_bounded'].values()) < 1e-3
  # r* at three budgets across the grid's compute, never decreasing with compute
  budgets = [r['compute'] for r in res['r_star']]
  assert budgets == sorted(budgets) and len(budgets) == 3
  assert [r['r'] for r in res['r_star']] == sorted(r['r'] for r in res['r_star'])
  report = (tmp_path / 'report.md').read_text()
  assert 'loop_sparse_bounded' in report and 'Different scale' in report
  assert 'held at 0' in report and 'Not distinguishable' not in report
  stored = json.loads((tmp_path / 'results.json').read_text())
  assert stored['distinguishable'] is True and len(stored['r_star']) == 3
  assert (tmp_path / 'fits.png').read_bytes()[:4] == b'\x89PNG'


def test_loop_laws_report_names_no_winner_when_forms_tie(tmp_path, monkeypatch):
  # a form against itself can never be told apart (the statistical cases of `rank` are in
  # tests/test_scaling_rank.py): the report must say so and name no winner
  truth = from_params('loop_bounded', {'A': 400.0, 'B': 1500.0, 'E': 1.8, 'alpha': 0.34,
                                       'beta': 0.36, 'delta_e': 0.1, 'gamma': 2.0,
                                       'beta_r': 0.6})
  monkeypatch.setattr(reproduce.loop_laws, 'FORMS', ('loop_bounded', 'loop_bounded'))
  monkeypatch.setattr(reproduce.common, '_sweep',
                      lambda cfg, grid, out, log: _loop_law_rows(truth, grid, 0.003, seed=5))
  res = reproduce.run('loop_laws', str(tmp_path), 'cpu', log=lambda *_: None)
  assert not res['distinguishable'] and len(res['indistinguishable_from_best']) == 1
  assert 'Not distinguishable' in (tmp_path / 'report.md').read_text()


def test_smelt_report_recovers_a_known_law_per_architecture(tmp_path, monkeypatch):
  from loopmoe_jax.scaling import smelt_analysis
  laws = {'baseline': dict(E=1.9, A=60.0, b=0.6, a=0.3, K=300.0, c=0.35),
          'looped': dict(E=1.9, A=45.0, b=0.6, a=0.3, K=300.0, c=0.35)}
  probes = {v: {'probes': {'qkv_cosine': {'q': [[[1.0, 0.9], [0.9, 1.0]]]
                                           if v == 'looped' else [[[1.0]]]},
                            'sink_mass': {'core': [[0.1, 0.2]]}},
                'dyck': {'0': {'accuracy': 0.25}, '32': {'refused': 'too long'}}}
            for v in laws}  # the real probes are tested in test_probes.py
  probed = {}
  _smelt_fakes(monkeypatch, laws, probes, seen=probed)
  res = reproduce.run('smelt', str(tmp_path), 'cpu', log=lambda *_: None)
  # the probes see the compute-matched pair (each config's own width and experts), longest run
  from loopmoe_jax.experiment import load_config
  for v in laws:
    m = load_config(f'configs/smelt.py:smoke,{v}').model
    assert probed[v] == f'{tmp_path}/{v}/w{m.d_model}_e{m.core_experts}_s200'
  text = (tmp_path / 'report.md').read_text()
  assert '| looped | q cosine, visits 1-2 | 0.900 |' in text and '| 0.25 | refused |' in text
  for arch, p in laws.items():
    assert res['frontier'][arch]['gamma'] == pytest.approx(
        smelt_analysis.frontier_exponent(p), rel=1e-2)
  s = {a: float(np.median([r['S'] for r in res['points'] if r['arch'] == a])) for a in laws}
  truth = smelt_analysis.compute_efficiency(laws['baseline'], laws['looped'],
                                            res['matched_loss'], s['baseline'], s['looped'])
  assert truth > 0.05 and res['compute_efficiency'] == pytest.approx(truth, abs=0.01)
  assert sorted(res['matched_pair']['looped']) == [50, 100, 200]
  assert 'less training compute' in (tmp_path / 'report.md').read_text()


def test_unknown_replication_and_scale_are_errors(tmp_path):
  with pytest.raises(ValueError, match="unknown replication 'chinchilla'"):
    reproduce.run('chinchilla', str(tmp_path))
  with pytest.raises(ValueError, match="--scale='tpu'"):
    reproduce.run('foil', str(tmp_path), 'tpu')


def _smelt_fakes(monkeypatch, laws, probes, seen=None):
  """The smelt pipeline's runs stubbed: losses from `laws` per architecture over its grid
  (F from the width, S from the experts), and `probes` as the probes' answer (the pair's
  workdirs they were asked about recorded in `seen`)."""
  def fake_sweep(cfg, grid, out, log):
    p = laws[os.path.basename(out)]
    rows = []
    for w in grid['model.d_model']:
      for e in grid['model.core_experts']:
        for s in grid['train.steps']:
          f, sp, d = 2e3 * w ** 2, 1 - 4.0 / e, s * 1024.0
          rows.append({'steps': s, 'D': d, 'F': f, 'S': sp, 'C': 3 * f * d,
                       'loss': p['E'] + p['A'] * (1 - sp) ** p['b'] / f ** p['a']
                               + p['K'] / d ** p['c'],
                       'model.d_model': w, 'model.core_experts': e,
                       'workdir': f'{out}/w{w}_e{e}_s{s}'})
    return rows

  def fake_probes(pair_dirs, log):
    if seen is not None:
      seen.update(pair_dirs)
    return {v: {'workdir': d, **probes[v]} for v, d in pair_dirs.items()}
  monkeypatch.setattr(reproduce.common, '_sweep', fake_sweep)
  monkeypatch.setattr(reproduce.smelt, 'smelt_probes', fake_probes)
  monkeypatch.setitem(reproduce.SMELT_RESAMPLES, 'cpu', 6)


def test_smelt_report_quotes_the_paper_and_the_saving_across_compute(tmp_path, monkeypatch):
  from loopmoe_jax.scaling import smelt_analysis as sa
  # the looped law has the larger exponents (as the paper's): its saving grows with compute
  laws = {'baseline': dict(E=1.9, A=60.0, b=0.6, a=0.30, K=300.0, c=0.35),
          'looped': dict(E=1.9, A=70.0, b=0.6, a=0.33, K=330.0, c=0.38)}
  cos = lambda x: [[[1.0, x], [x, 1.0]], [[1.0, x + 0.02], [x + 0.02, 1.0]]]
  probes = {'baseline': {'probes': {'qkv_cosine': {n: [[[1.0]]] * 2 for n in 'qkv'},
                                    'sink_mass': {'core': [[0.4], [0.5]]}},
                         'dyck': {'0': {'accuracy': 0.5}, '8': {'accuracy': 0.25},
                                  '32': {'refused': 'too long'}}},
            'looped': {'probes': {'qkv_cosine': {'q': cos(0.9), 'k': cos(0.8), 'v': cos(0.6)},
                                  'sink_mass': {'core': [[0.5, 0.1], [0.3, 0.05]]}},
                       'dyck': {'0': {'accuracy': 0.5}, '8': {'accuracy': 0.375},
                                '32': {'refused': 'too long'}}}}
  _smelt_fakes(monkeypatch, laws, probes)
  reproduce.run('smelt', str(tmp_path), 'cpu', log=lambda *_: None)
  res = json.loads((tmp_path / 'results.json').read_text())
  base = [p for p in res['points'] if p['arch'] == 'baseline']
  assert res['compute_window'] == [min(p['C'] for p in base), max(p['C'] for p in base)]
  assert res['efficiency_cells'] == 4 and res['efficiency_resamples'] == 6
  s_b, s_n = res['efficiency_sparsity']
  rows = res['compute_efficiency_range']
  assert [r['at'] for r in rows][::len(rows) - 1] == ['min compute', 'max compute']
  assert len(rows) == 2 + 3  # and one per training length
  for r in rows:
    truth = sa.saving_at_compute(laws['baseline'], laws['looped'], r['compute'], s_b, s_n)
    assert r['value'] == pytest.approx(truth, abs=1e-3) and r['ci'][0] <= r['value'] <= r['ci'][1]
  assert np.all(np.diff([r['compute'] for r in rows]) > 0)
  assert np.all(np.diff([r['value'] for r in rows]) > 0)
  # the quoted constants agree with each other: gamma = a c / (a + c) per architecture
  paper = reproduce.smelt.PAPER
  for v in ('baseline', 'looped'):
    assert sa.frontier_exponent({k: paper[k][v] for k in 'ac'}) == pytest.approx(
        paper['gamma'][v], abs=5e-4)
  assert res['paper']['dyck'] == {'baseline': 0.264, 'looped': 0.298}
  assert res['probe_summary']['v'] == pytest.approx([0.6, 0.62])
  assert res['probe_summary']['sink'] == pytest.approx([0.4, 0.075])
  text = (tmp_path / 'report.md').read_text()
  for row in ('| a (looped) | 0.33 | 0.3892 |', '| c (baseline) | 0.35 | 0.6594 |',
              '| gamma (looped) |', '| V cosine between visits (looped) | 0.6-0.62 | 0.65-0.74 |',
              '| q 0.9-0.92, k 0.8-0.82 | 0.89-0.93 |',
              '| 0.400 -> 0.075 (probe tokens) | 0.60 -> 0.02 (Dyck case study) |',
              '| Dyck accuracy (baseline) | 25.0% at 8 shots | 26.4% at 32 shots |',
              '| Dyck accuracy (looped) | 37.5% at 8 shots | 29.8% at 32 shots |',
              '6.8% -> 18.0%', 'Shortcuts this run took', 'none fixed', '(the paper: 2,000)'):
    assert row in text, row
  assert 'values of the second visit stay close' not in text
  assert "differs from the baseline's" not in text


# Foil ------------------------------------------------------------------------------------------

def _textbook_pair(a: dict, b: dict) -> dict:
  """Paired statistics of A - B over the steps both hold, written out with loops."""
  import math
  steps = sorted(set(a) & set(b))
  d = [a[s] - b[s] for s in steps]
  n = len(d)
  m = sum(d) / n
  ss = sum((x - m) ** 2 for x in d)
  rho = sum((d[t] - m) * (d[t + 1] - m) for t in range(n - 1)) / ss
  n_eff = min(n, max(1.0, n * (1 - rho) / (1 + rho)))
  sd = math.sqrt(ss / (n - 1))
  return {'n': n, 'mean_diff': m, 'se': sd / math.sqrt(n), 'lag1_autocorr': rho,
          'n_eff': n_eff, 'se_eff': sd / math.sqrt(n_eff)}


def _fake_foil_sweep(seen):
  """A sweep that writes what the trainer leaves for one point: a checkpoint config, metrics
  every step, final_steps.jsonl for the final window (after rows an earlier, shorter
  invocation left before it), routing and summary. Losses share one per-step batch noise
  (one data order) plus a variant offset and AR(1) noise of the variant's own."""
  offsets = {'base': 0.0, 'foil3': -0.01, 'foil2': -0.02, 'foil1': -0.015, 'base_tied': 0.008}

  def sweep(cfg, grid, out, log):
    v = os.path.basename(out)
    seen[v] = cfg
    steps, fw = cfg.train.steps, cfg.train.final_window
    shared = np.random.default_rng(7).standard_normal(steps + 1) * 0.05
    own = np.random.default_rng(len(seen)).standard_normal(steps + 1) * 0.01
    for t in range(1, steps + 1):
      own[t] += 0.7 * own[t - 1]
    loss = {t: 3.0 - t / steps + shared[t] + own[t] + offsets[v] for t in range(1, steps + 1)}
    wd = os.path.join(out, 'runs', f'train.steps={steps}')
    os.makedirs(os.path.join(wd, 'checkpoints', str(steps), 'config'))
    with open(os.path.join(wd, 'checkpoints', str(steps), 'config', 'metadata'), 'w') as f:
      f.write(cfg.to_json())
    with open(os.path.join(wd, 'metrics.jsonl'), 'w') as f:
      f.writelines(json.dumps({'step': t, 'loss': x}) + '\n' for t, x in loss.items())
    with open(os.path.join(wd, 'final_steps.jsonl'), 'w') as f:
      f.writelines(json.dumps({'step': t, 'loss': 9.0}) + '\n' for t in range(1, 11))
      f.writelines(json.dumps({'step': t, 'loss': loss[t]}) + '\n'
                   for t in range(steps - fw + 1, steps + 1))
    with open(os.path.join(wd, 'routing.jsonl'), 'w') as f:
      f.writelines(json.dumps({'step': steps, 'segment': 'core', 'pass': p, 'max_vio': 0.5})
                   + '\n' for p in range(cfg.model.num_loops))
    window = [loss[t] for t in range(steps - fw + 1, steps + 1)]
    with open(os.path.join(wd, 'summary.json'), 'w') as f:
      json.dump({'steps': steps, 'final_window_loss': float(np.mean(window)),
                 'val_loss': loss[steps]}, f)
    return [{'workdir': wd}]
  return sweep


def _fake_diagnostics(workdir, out_dir, scale, log=print):
  mmr = 1.6 if 'base_tied' in workdir else 2.0
  return {'probe_set': {'tokens': 4096, 'windows': 32, 'seq_len': 128, 'masked_tail': 0,
                        'split': 'embedded corpus (validation)', 'setting': '--tokens=4096'},
          'segments': {'core': {'U_mean': 20.0, 'U_normalized': 0.6, 'B2_pooled': [0.9],
                                'B2_per_pass': [[0.8, 0.8]], 'MaxVio_global': [0.3],
                                'MMR_overall': mmr, 'MMR_per_pass': [mmr, mmr]}}}


def test_foil_pairs_every_step_of_the_final_window_with_the_tied_control(tmp_path, monkeypatch):
  """The replication trains Base, Foil-3/2/1 and Base-tied (same data and seed, a recorded
  final window), and its paired statistics equal the textbook ones over the final_steps
  records of the final window (not the logged steps, not the rows before the window)."""
  from loopmoe_jax.train.run import RunDir
  seen = {}
  monkeypatch.setattr(reproduce.common, '_sweep', _fake_foil_sweep(seen))
  monkeypatch.setattr(reproduce.foil, 'routing_diagnostics', _fake_diagnostics)
  res = reproduce.run('foil', str(tmp_path), 'cpu', log=lambda *_: None)
  assert list(seen) == ['base', 'foil3', 'foil2', 'foil1', 'base_tied']
  steps, fw = reproduce.foil.STEPS['cpu'], reproduce.foil.FINAL_WINDOW['cpu']
  for v, cfg in seen.items():
    assert (cfg.train.steps, cfg.train.final_window) == (steps, fw)
    assert cfg.model.tie_attention == (v == 'base_tied')
    assert cfg.data.to_dict() == seen['base'].data.to_dict()
    assert cfg.train.seed == seen['base'].train.seed
  window = range(steps - fw + 1, steps + 1)
  rec = {}
  for v in seen:
    rows = [json.loads(l) for l in open(tmp_path / v / 'runs' / f'train.steps={steps}'
                                        / 'final_steps.jsonl')]
    rec[v] = {r['step']: r['loss'] for r in rows if r['step'] in window}
    assert sorted(rec[v]) == list(window)
  pairs = [(v, 'base', 'paired_diff_vs_base') for v in ('foil3', 'foil2', 'foil1', 'base_tied')]
  pairs += [(v, 'base_tied', 'paired_diff_vs_base_tied')
            for v in ('base', 'foil3', 'foil2', 'foil1')]
  for a, b, key in pairs:
    want = _textbook_pair(rec[a], rec[b])
    for k, x in want.items():
      assert res[a][key][k] == pytest.approx(x, rel=1e-9), (a, b, k)
  assert res['paired_window']['steps'] == [window[0], window[-1]]
  assert res['paired_window']['n'] == fw
  assert res['mmr_gap_untied_vs_tied']['relative'] == pytest.approx(2.0 / 1.6 - 1)
  saved = json.loads((tmp_path / 'results.json').read_text())
  for v in reproduce.foil.VARIANTS:  # the keys results.json has always had, and the new ones
    assert {'shape', 'params', 'val_loss', 'final_window_loss', 'max_vio_by_pass',
            'diagnostics'} <= set(saved[v])
  assert saved['paper']['U_mean_20B'] == {'base': 24.1, 'foil3': 17.8, 'foil2': 12.5,
                                          'foil1': 9.7}
  text = (tmp_path / 'report.md').read_text()
  assert f'steps {window[0]}..{window[-1]}' in text and '-0.007 (20B), -0.012 (100B)' in text
  assert '| base - base_tied |' in text and '4,096 tokens' in text
  # a run without every step of its final window recorded is refused, naming it
  wd = str(tmp_path / 'base' / 'runs' / f'train.steps={steps}')
  with open(os.path.join(wd, 'final_steps.jsonl'), 'w') as f:
    f.writelines(json.dumps({'step': t, 'loss': 1.0}) + '\n' for t in window[1:])
  assert len(RunDir(wd).final_steps()) == fw - 1
  with pytest.raises(ValueError, match=f'{wd}: final_steps.jsonl lacks 1 of the {fw} steps'):
    reproduce.foil.window_steps(wd, steps, fw)


@pytest.mark.parametrize('smoke', ['', ',smoke'])
def test_foil_base_tied_differs_from_base_only_in_attention_tying(smoke):
  """Same FLOPs; the parameter trees differ by the per-pass attention alone, C (L - 1) sets of
  d_model x head dim x (2 heads + 2 KV heads); full size, the paper's 553.7M and 520.2M."""
  import jax
  from loopmoe_jax.accounting import count
  from loopmoe_jax.config import ModelConfig
  from loopmoe_jax.experiment import load_config
  from helpers import param_shapes
  cfgs = {v: load_config(f'configs/foil.py:{v}{smoke}') for v in ('base', 'base_tied')}
  flat = {v: dict(jax.tree_util.tree_flatten_with_path(c.to_dict())[0]) for v, c in cfgs.items()}
  differ = [jax.tree_util.keystr(k) for k in flat['base'] if flat['base'][k] != flat['base_tied'][k]]
  assert differ == ["['model']['tie_attention']"]
  mc = {v: ModelConfig.from_dict(c.model) for v, c in cfgs.items()}
  trees = {v: param_shapes(m) for v, m in mc.items()}
  size = lambda t: sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(t))
  m = mc['base']
  attn = m.d_model * m.resolved_head_dim * (2 * m.num_heads + 2 * m.kv_heads)
  assert size(trees['base']) - size(trees['base_tied']) == m.core_layers * (m.num_loops - 1) * attn
  no_attn = {v: {jax.tree_util.keystr(p): x.shape for p, x in
                 jax.tree_util.tree_leaves_with_path(t) if 'attn' not in jax.tree_util.keystr(p)}
             for v, t in trees.items()}
  assert no_attn['base'] == no_attn['base_tied']
  acct = {v: count(x) for v, x in mc.items()}
  assert acct['base']['flops_per_token'] == acct['base_tied']['flops_per_token']
  for v in mc:
    assert acct[v]['params_total'] == size(trees[v])
    if not smoke:
      assert round(acct[v]['params_total'] / 1e6, 1) == reproduce.foil.PAPER['params_M'][v]
