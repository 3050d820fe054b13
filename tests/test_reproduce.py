"""scripts/reproduce.py's analyses on rows from known laws (the training runs stubbed: the
real CPU runs are the script's job, quoted in the closing notes)."""
import json
import os

import numpy as np
import pytest

from loopmoe_jax import replicate as reproduce
from loopmoe_jax.scaling import from_params


def test_loop_laws_report_ranks_the_generating_form(tmp_path, monkeypatch):
  truth = from_params('loop_sparse_bounded', {'A': 400.0, 'B': 0.0, 'E': 1.8, 'alpha': 0.34,
                                              'beta': 0.36, 'gamma0': 1.0, 'beta0': 0.8,
                                              'delta': 0.3})

  def fake_sweep(cfg, grid, out, log):
    rows = []
    for r in grid['model.num_loops']:
      for e in grid['model.core_experts']:
        n = 3e5 + 2e4 * e
        row = {'point': f'r={r},E={e}', 'N_active_pass': 3e5, 'N_block_active': 1.5e5,
               'N_stored': n, 'D': 2e5, 'C': 3 * 6e5 * 2e5 * r, 'r': float(r), 'E': float(e),
               'k': 2.0, 'steps': 200}
        row['loss'] = float(truth.predict({k: np.atleast_1d(v) for k, v in row.items()
                                           if k != 'point'})[0])
        rows.append(row)
    return rows
  monkeypatch.setattr(reproduce.common, '_sweep', fake_sweep)
  res = reproduce.run('loop_laws', str(tmp_path), 'cpu', log=lambda *_: None)
  assert res['best_form'] == 'loop_sparse_bounded'
  assert res['table'][0]['heldout_mean'] < 0.02 and res['table'][0]['rmse'] < 1e-3
  report = (tmp_path / 'report.md').read_text()
  assert 'loop_sparse_bounded' in report and 'Different scale' in report
  assert json.loads((tmp_path / 'results.json').read_text())['points'] == 9
  assert (tmp_path / 'fits.png').read_bytes()[:4] == b'\x89PNG'


def test_smelt_report_recovers_a_known_law_per_architecture(tmp_path, monkeypatch):
  from loopmoe_jax.scaling import smelt_analysis
  laws = {'baseline': dict(E=1.9, A=60.0, b=0.6, a=0.3, K=300.0, c=0.35),
          'looped': dict(E=1.9, A=45.0, b=0.6, a=0.3, K=300.0, c=0.35)}

  def fake_sweep(cfg, grid, out, log):
    p = laws[os.path.basename(out)]
    rows = []
    for w in grid['model.d_model']:
      for e in grid['model.core_experts']:
        for s in grid['train.steps']:
          f, sp, d = 2e3 * w ** 2, 1 - 4.0 / e, s * 1024.0
          row = {'steps': s, 'D': d, 'F': f, 'S': sp, 'C': 3 * f * d,
                 'loss': p['E'] + p['A'] * (1 - sp) ** p['b'] / f ** p['a']
                         + p['K'] / d ** p['c']}
          rows.append(row | {'model.d_model': w, 'model.core_experts': e,
                             'workdir': f'{out}/w{w}_e{e}_s{s}'})
    return rows
  probed = {}

  def fake_probes(pair_dirs, log):  # the real probes are tested in test_probes.py
    probed.update(pair_dirs)
    return {v: {'workdir': d, 'probes': {'qkv_cosine': {'q': [[[1.0, 0.9], [0.9, 1.0]]]
                                                        if v == 'looped' else [[[1.0]]]},
                                         'sink_mass': {'core': [[0.1, 0.2]]}},
                'dyck': {'0': {'accuracy': 0.25}, '32': {'refused': 'too long'}}}
            for v, d in pair_dirs.items()}
  monkeypatch.setattr(reproduce.common, '_sweep', fake_sweep)
  monkeypatch.setattr(reproduce.smelt, 'smelt_probes', fake_probes)
  monkeypatch.setitem(reproduce.SMELT_RESAMPLES, 'cpu', 8)
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
