"""Smoke test of scripts/benchmark.py: the quick `model` benchmark runs and reports numbers.
No timing thresholds: those belong to the benchmark's own PASS/FAIL lines."""
import json
import math

import jax

from loopmoe_jax import bench
from loopmoe_jax.bench import model as bench_model

REQUIRED = ('compile_s_L1', 'compile_s_L16', 'compile_ratio_L16_over_L1', 'step_s_scan',
            'step_s_unroll', 'step_s_unrolled', 'loop_over_unrolled',
            'loop_unroll_impl_over_unrolled', 'moe_s_tiled_E8', 'moe_s_tiled_E64',
            'moe_E64_over_E8', 'step_s_plain', 'step_s_bias', 'bias_step_over_plain')


def test_model_benchmark_quick(tmp_path, capsys, monkeypatch):
  """Also: the compile times it reports are real compiles although the persistent compilation
  cache is on (this test session's conftest turns it on): none of them is answered from the
  cache, where compiling a step the benchmark ran (and so cached) again is."""
  assert 'model' in bench.SUBCOMMANDS
  hits, timed = [], []
  def listener(event, **_):
    if event == '/jax/compilation_cache/cache_hits':
      hits.append(event)
  def counted(*args, **kw):
    before = len(hits)
    out = compile_seconds(*args, **kw)
    timed.append(len(hits) - before)
    return out
  compile_seconds = bench.compile_seconds
  monkeypatch.setattr(bench_model, 'compile_seconds', counted)
  path = tmp_path / 'model.json'
  jax.monitoring.register_event_listener(listener)
  try:
    res = bench.run('model', quick=True, json_path=str(path))
    # the control: the loop-vs-unrolled section's 'scan' step (quick sizes), compiled again
    looped = bench_model._cfg(True, prelude_layers=0, coda_layers=0, core_layers=1, core_experts=8,  # pylint: disable=protected-access
                        num_loops=2, tie_attention=True)
    before = len(hits)
    bench.step_seconds({'scan': looped}, bench._batch(looped, 2, 32), 1, bench.FAST_COMPILE)  # pylint: disable=protected-access
    again = len(hits) - before
  finally:
    jax.monitoring.unregister_event_listener(listener)
  assert timed == [0] and again >= 1
  for key in REQUIRED:
    assert key in res, key
    assert isinstance(res[key], float) and math.isfinite(res[key]) and res[key] > 0, (key, res[key])
  for key, value in res.items():  # informational entries: a positive number or None (skipped)
    if isinstance(value, float):
      assert math.isfinite(value) and value > 0, (key, value)
  assert json.loads(path.read_text()) == res
  out = capsys.readouterr().out
  assert 'moe_E64_over_E8' in out and ('PASS' in out or 'FAIL' in out)


def test_kernels_moe_layer_checks_pallas_and_times_every_stage():
  """The device part of `benchmark.py kernels`, run on CPU at a tiny shape (interpreted
  kernels): the all-Pallas MoE layer's loss and gradients match the xla dispatch's, and every
  stage of it is timed."""
  from loopmoe_jax.bench import kernels as bench_kernels
  res = {}
  tiles = {'gmm': {'family': 'gpu', 'tile_m': 16, 'tile_n': 16, 'tile_k': 16},
           'tgmm': {'family': 'gpu', 'tile_m': 16, 'tile_n': 16, 'tile_k': 16}}
  bench_kernels._moe_layer(res, 'cpu', 64, 32, 16, 4, 2, tiles, 1)  # pylint: disable=protected-access
  assert res['cpu_moe_pallas_err'] < 1e-2  # bf16 operands, float32 sums
  assert set(res['cpu_moe_stage_share']) == {'route', 'permute', 'gate_up', 'down', 'combine'}
  assert all(v > 0 for v in res['cpu_moe_stage_share'].values())


def test_verdicts_read_upper_and_lower_bounds():
  from loopmoe_jax import bench
  upper, lower = 'loss_temp_over_logits', 'step_time_r8_over_r2'
  assert bench.TARGETS[lower][0] == '>=' and not isinstance(bench.TARGETS[upper], tuple)
  hi, lo = bench.TARGETS[upper], bench.TARGETS[lower][1]
  got = bench.verdicts({upper: hi * 0.99, lower: lo * 1.01, 'compiled_programs': 9,
                        'decode_exit_over_full': float('nan')})
  assert got == {upper: True, lower: True, 'compiled_programs': False,
                 'decode_exit_over_full': False}
  got = bench.verdicts({upper: hi * 1.01, lower: lo * 0.99, 'compiled_programs': 8})
  assert got == {upper: False, lower: False, 'compiled_programs': True}
  assert '>= 2.5  FAIL' in bench.format_table({lower: lo * 0.99})
