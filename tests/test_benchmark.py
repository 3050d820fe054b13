"""Smoke test of scripts/benchmark.py: the quick `model` benchmark runs and reports numbers.
No timing thresholds: those belong to the benchmark's own PASS/FAIL lines."""
import json
import math

from loopmoe_jax import bench

REQUIRED = ('compile_s_L1', 'compile_s_L16', 'compile_ratio_L16_over_L1', 'step_s_scan',
            'step_s_unroll', 'step_s_unrolled', 'loop_over_unrolled',
            'loop_unroll_impl_over_unrolled', 'moe_s_tiled_E8', 'moe_s_tiled_E64',
            'moe_E64_over_E8')


def test_model_benchmark_quick(tmp_path, capsys):
  assert 'model' in bench.SUBCOMMANDS
  path = tmp_path / 'model.json'
  res = bench.run('model', quick=True, json_path=str(path))
  for key in REQUIRED:
    assert key in res, key
    assert isinstance(res[key], float) and math.isfinite(res[key]) and res[key] > 0, (key, res[key])
  for key, value in res.items():  # informational entries: a positive number or None (skipped)
    if isinstance(value, float):
      assert math.isfinite(value) and value > 0, (key, value)
  assert json.loads(path.read_text()) == res
  out = capsys.readouterr().out
  assert 'moe_E64_over_E8' in out and ('PASS' in out or 'FAIL' in out)
