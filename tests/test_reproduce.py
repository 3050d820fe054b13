"""scripts/reproduce.py's analyses on rows from known laws (the training runs stubbed: the
real CPU runs are the script's job, quoted in the closing notes)."""
import json
import os

import numpy as np
import pytest

from loopmoe_jax import reproduce
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
  monkeypatch.setattr(reproduce, '_sweep', fake_sweep)
  res = reproduce.run('loop_laws', str(tmp_path), 'cpu', log=lambda *_: None)
  assert res['best_form'] == 'loop_sparse_bounded'
  assert res['table'][0]['heldout_mean'] < 0.02 and res['table'][0]['rmse'] < 1e-3
  report = (tmp_path / 'report.md').read_text()
  assert 'loop_sparse_bounded' in report and 'Different scale' in report
  assert json.loads((tmp_path / 'results.json').read_text())['points'] == 9
  assert (tmp_path / 'fits.png').read_bytes()[:4] == b'\x89PNG'


def test_smelt_report_saves_the_compute_a_known_law_says(tmp_path, monkeypatch):
  laws = {'baseline': (1.9, 300.0, 0.35, 1.0e6), 'looped': (1.9, 250.0, 0.35, 1.0e6)}

  def fake_sweep(cfg, grid, out, log):
    e, k, c, f = laws[os.path.basename(out)]
    return [{'steps': s, 'D': s * 1024.0, 'F': f, 'S': 0.5, 'C': 3 * f * s * 1024.0,
             'loss': e + k / (s * 1024.0) ** c} for s in grid['train.steps']]
  monkeypatch.setattr(reproduce, '_sweep', fake_sweep)
  res = reproduce.run('smelt', str(tmp_path), 'cpu', log=lambda *_: None)
  # same F: at a matched loss C_loop / C_base = (K_loop / K_base)^(1/c)
  assert res['compute_efficiency'] == pytest.approx(1 - (250 / 300) ** (1 / 0.35), rel=1e-4)
  assert 'saves' in (tmp_path / 'report.md').read_text()


def test_unknown_replication_and_scale_are_errors(tmp_path):
  with pytest.raises(ValueError, match="unknown replication 'chinchilla'"):
    reproduce.run('chinchilla', str(tmp_path))
  with pytest.raises(ValueError, match="--scale='tpu'"):
    reproduce.run('foil', str(tmp_path), 'tpu')
