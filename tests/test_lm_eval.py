"""The LM Evaluation Harness adapter (analysis/lm_harness.py) and the offline task pack
(loopmoe_jax/lm_tasks): scores against a direct full forward, generation against
decode.generate, the pack's rows against the corpus, and the task end to end through the harness.

A tiny random-init byte-level model (trained length M = 32) stands in for a checkpoint: the
adapter takes a run.Loaded as it takes a workdir."""
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

lm_eval = pytest.importorskip('lm_eval')
from lm_eval.api.instance import Instance  # noqa: E402

from helpers import logged, make_params  # noqa: E402
from loopmoe_jax import experiment, lm_tasks, sharding  # noqa: E402
from loopmoe_jax.config.mesh import MeshConfig  # noqa: E402
from loopmoe_jax.analysis import lm_harness  # noqa: E402
from loopmoe_jax.config import model_config_dict  # noqa: E402
from loopmoe_jax.data import corpus  # noqa: E402
from loopmoe_jax.decode import generate  # noqa: E402
from loopmoe_jax.experiment import experiment_config  # noqa: E402
from loopmoe_jax.model import LoopedMoE  # noqa: E402
from loopmoe_jax.train.run import Loaded  # noqa: E402

M = 32  # the tiny run's data.seq_len: the adapter's trained length
BATCH = 4
BUCKETS = (16, 32)


def _loaded(**model_kw) -> Loaded:
  model = model_config_dict(vocab_size=256, d_model=32, num_heads=2, expert_width=32,
                            prelude_layers=1, prelude_experts=4, core_layers=1, core_experts=4,
                            num_loops=2, coda_layers=0, dispatch='xla', **model_kw)
  cfg = experiment_config(model, data=dict(seq_len=M, batch_size=4))
  exp = experiment.build(cfg)
  return Loaded('(tiny)', exp, make_params(exp.model), None, 0, cfg.to_dict())


@pytest.fixture(scope='module')
def run():
  return _loaded(tie_attention=True)


@functools.lru_cache(maxsize=None)
def _forward(cfg, num_loops):
  return jax.jit(lambda p, x: LoopedMoE(cfg).apply({'params': p}, x, num_loops=num_loops)[0])


def direct(run, seq, start, num_loops=None):
  """(sum of log p(seq[t] | seq[:t]) over t >= start, every one the argmax): one unpadded
  forward over seq[:-1], float32 logits, the log-softmax in float64."""
  logits = np.asarray(_forward(run.model_cfg, num_loops)(run.params,
                                                         jnp.asarray([seq[:-1]], jnp.int32)),
                      np.float64)[0]
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                          keepdims=True)) \
      - logits.max(-1, keepdims=True)
  t = np.arange(start, len(seq))
  return float(logp[t - 1, np.asarray(seq)[t]].sum()), bool(
      (logits[t - 1].argmax(-1) == np.asarray(seq)[t]).all())


def ll_requests(pairs):
  return [Instance('loglikelihood', {}, pair, i) for i, pair in enumerate(pairs)]


def byte_ids(text):
  return list(text.encode())


# Contexts and continuations whose sequences (EOS or context, then continuation) all take 20
# tokens, so the direct reference compiles one program; the adapter pads them to its buckets.
PAIRS = [('def f(x):\n    return', ' x + 1\n'),       # 20 = 19 + 1 ...
         ('', 'import os, sys, abc\n'),              # empty context: EOS first
         ('class A:\n  ', 'pass  # ok\n'),
         ('for i in range(10', '):\n')]


def _seq(pair):
  """(tokens, first scored position) as the harness scores a pair: the context's trailing
  whitespace belongs to the continuation; an empty context is EOS."""
  ctx, cont = pair
  ctx, cont = ctx.rstrip(), ctx[len(ctx.rstrip()):] + cont
  return ([0] if not ctx else byte_ids(ctx)) + byte_ids(cont), max(1, len(byte_ids(ctx)))


def test_loglikelihood_equals_the_direct_sum_and_greedy_flag(run):
  lm = lm_harness.LoopedMoELM(run, batch_size=BATCH, buckets=BUCKETS)
  got = lm.loglikelihood(ll_requests(PAIRS))
  for pair, (lp, greedy) in zip(PAIRS, got):
    want_lp, want_greedy = direct(run, *_seq(pair))
    assert lp == pytest.approx(want_lp, abs=1e-4), pair
    assert greedy == want_greedy
  # a continuation that is the model's own argmax path is greedy (a random model's byte text
  # never is): the adapter's scorer on token sequences
  prompt = byte_ids('def f(x):\n')
  path = np.asarray(generate(run.model_cfg, run.params, jnp.asarray([prompt]), 6,
                             jax.random.key(0)))[0].tolist()
  wrong = path[:-1] + [(path[-1] + 1) % 256]
  (lp, greedy), (_, greedy2) = lm.score([(path, len(prompt)), (wrong, len(prompt))])
  assert greedy and not greedy2
  assert lp == pytest.approx(direct(run, path, len(prompt))[0], abs=1e-4)


def test_batched_one_at_a_time_and_passes(run):
  pairs = PAIRS + [('x = [1, 2, 3]\ny = ', 'x[::-1]\n'), ('if a and b', ':\n')]
  batched = lm_harness.LoopedMoELM(run, batch_size=BATCH, buckets=BUCKETS).loglikelihood(
      ll_requests(pairs))
  single = lm_harness.LoopedMoELM(run, batch_size=1, buckets=(M,)).loglikelihood(
      ll_requests(pairs))
  np.testing.assert_allclose([lp for lp, _ in batched], [lp for lp, _ in single], atol=1e-4)
  assert [g for _, g in batched] == [g for _, g in single]
  one = lm_harness.LoopedMoELM(run, num_loops=1, batch_size=BATCH,
                               buckets=BUCKETS).loglikelihood(ll_requests(pairs))
  assert np.min(np.abs(np.subtract([lp for lp, _ in one], [lp for lp, _ in batched]))) > 1e-3
  for pair, (lp, _) in zip(PAIRS, one):  # and the 1-pass numbers are the 1-pass forward's
    assert lp == pytest.approx(direct(run, *_seq(pair), num_loops=1)[0], abs=1e-4)
  # on a data2 x expert2 mesh (params sharded as for training, rows split): the same scores
  mesh = sharding.make_mesh(MeshConfig(data=2, expert=2), jax.devices()[:4])
  on_mesh = lm_harness.LoopedMoELM(run, batch_size=BATCH, buckets=BUCKETS,
                                   mesh=mesh).loglikelihood(ll_requests(pairs))
  np.testing.assert_allclose([lp for lp, _ in on_mesh], [lp for lp, _ in batched], atol=1e-4)
  with pytest.raises(ValueError, match=r"--batch_size=3: must be a multiple of the mesh's"):
    lm_harness.LoopedMoELM(run, batch_size=3, mesh=mesh)


def test_windows_score_every_token_once_with_its_own_prefix():
  for length, start, most in ((71, 1, 8), (71, 5, 8), (71, 70, 8), (71, 30, 64), (9, 1, 1),
                              (20, 20, 8)):
    scored = []
    for lo, end, n in lm_harness.windows(length, start, most):
      assert 0 <= lo < end <= length and end - 1 - lo <= most and 1 <= n <= end - 1 - lo
      scored += list(range(end - n, end))  # the target positions this window scores
    assert scored == list(range(start, length))
    if start < length:  # the last window: the full context the model was trained with
      assert end - 1 - lo == min(most, length - 1)


def test_rolling_and_long_requests_equal_the_direct_windows(run, caplog):
  lm = lm_harness.LoopedMoELM(run, batch_size=BATCH, buckets=BUCKETS)
  short = 'import os, sys, abc'  # EOS + 19 bytes: the same 20-token program as above
  long = 'def main(argv):\n  del argv\n  return [x * x for x in range(17)]\n'  # 62 bytes > M
  got = lm.loglikelihood_rolling([Instance('loglikelihood_rolling', {}, (t,), i)
                                  for i, t in enumerate((short, long))])
  assert got[0] == pytest.approx(direct(run, [0] + byte_ids(short), 1)[0], abs=1e-4)
  seq = [0] + byte_ids(long)
  want = 0.0
  for lo, end, n in lm_harness.windows(len(seq), 1, M):
    want += direct(run, seq[lo:end], end - lo - n)[0]
  assert got[1] == pytest.approx(want, abs=1e-4)
  # a context longer than M is cut from the left, and the cut is reported
  ctx, cont = 'x' * 40 + 'def f(a, b):', '\n  return a\n'
  (lp, _), = lm.loglikelihood(ll_requests([(ctx, cont)]))
  seq = byte_ids(ctx + cont)[-(M + 1):]
  assert lp == pytest.approx(direct(run, seq, len(seq) - len(cont))[0], abs=1e-4)
  assert '1 of 1 loglikelihood requests are longer than the 32 tokens' in logged(caplog)


def _reference_text(new_ids, until):
  ids = list(new_ids)
  ids = ids[:ids.index(0)] if 0 in ids else ids
  text = bytes(ids).decode('utf-8', errors='replace')
  for stop in until:
    text = text.split(stop)[0] if stop in text else text
  return text


def test_generate_until_equals_generate_cut_at_until(run):
  steps = 8
  contexts = ['def f(x):\n', 'def g(y):\n', 'import sys\n']  # two prompt lengths: 10, 11
  full = {}
  for c in contexts:  # the reference: decode.generate on each prompt alone
    p = byte_ids(c)
    full[c] = np.asarray(generate(run.model_cfg, run.params, jnp.asarray([p]), steps,
                                  jax.random.key(0)))[0, len(p):].tolist()
  # cut each at a piece of its own text (so the cut happens), and one without a stop
  untils = {c: [_reference_text(full[c], [])[2:4] or 'never'] for c in contexts[:2]}
  untils[contexts[2]] = ['@@never@@']
  reqs = [Instance('generate_until', {}, (c, {'until': untils[c], 'max_gen_toks': steps}), i)
          for i, c in enumerate(contexts + contexts[:1])]
  for lm in (lm_harness.LoopedMoELM(run, batch_size=1),
             lm_harness.LoopedMoELM(run, batch_size=BATCH)):
    got = lm.generate_until(reqs)
    want = [_reference_text(full[r.args[0]], r.args[1]['until']) for r in reqs]
    assert got == want
  assert len(want[0]) < len(_reference_text(full[contexts[0]], []))  # the stop cut it


def test_the_offline_tasks_end_to_end_match_the_adapter(run):
  manager = lm_harness.task_manager(include_defaults=False)
  tasks = {'loopmoe_next_line': 'next_line.jsonl', 'loopmoe_line_end': 'line_end.jsonl'}
  out = lm_harness.evaluate(run, list(tasks), num_loops=(1, 2), limit=6, batch_size=BATCH,
                            manager=manager, bootstrap_iters=0)
  assert out['chance'] == {t: 0.25 for t in tasks}
  for n in (1, 2):  # the harness's accuracies are those of the adapter's own scores
    lm = lm_harness.LoopedMoELM(run, num_loops=n, batch_size=BATCH)
    for task, name in tasks.items():
      rows = lm_tasks.read_jsonl(os.path.join(lm_tasks.PACK_DIR, name))[:6]
      lp = np.reshape([x for x, _ in lm.loglikelihood(ll_requests(
          [(r['context'], c) for r in rows for c in r['choices']]))], (6, 4))
      lu = np.reshape([x for x, _ in lm.loglikelihood(ll_requests(
          [('', c) for r in rows for c in r['choices']]))], (6, 4))
      label = np.asarray([r['label'] for r in rows])
      res = out['passes'][str(n)]['results'][task]
      assert res['acc,none'] == pytest.approx(np.mean(lp.argmax(1) == label))
      assert res['acc_mutual_info,none'] == pytest.approx(np.mean((lp - lu).argmax(1) == label))
  json.dumps(out)  # JSON-safe as results.json needs
  text = lm_harness.table(out)
  row = next(l for l in text.splitlines() if l.startswith('| loopmoe_line_end | acc |'))
  cells = [c.strip().split(' ± ')[0] for c in row.strip('|').split('|')]
  assert cells == ['loopmoe_line_end', 'acc', '0.250'] + [
      f"{out['passes'][p]['results']['loopmoe_line_end']['acc,none']:.3f}" for p in ('1', '2')]


def test_bad_inputs_are_one_line_errors(run):
  manager = lm_harness.task_manager(include_defaults=False)
  with pytest.raises(ValueError, match=r"^unknown task 'loopmoe_next_lin' \(lm-eval .*\); "
                                       r'near names: loopmoe_next_line'):
    lm_harness.evaluate(run, ['loopmoe_next_lin'], manager=manager)
  untied = _loaded(tie_attention=False)  # weights for 2 passes only
  with pytest.raises(ValueError, match='num_loops=3 exceeds the trained model.num_loops=2'):
    lm_harness.evaluate(untied, ['loopmoe_next_line'], num_loops=(1, 3), manager=manager)
  with pytest.raises(ValueError, match='num_loops=17 exceeds the limit of 16 passes'):
    lm_harness.LoopedMoELM(run, num_loops=17)


@pytest.mark.parametrize('name', sorted(lm_tasks.FILES))
def test_the_pack_rows_are_held_out_text_with_its_true_continuation(name):
  rows = lm_tasks.read_jsonl(os.path.join(lm_tasks.PACK_DIR, name))
  with open(os.path.join(lm_tasks.PACK_DIR, 'build.json')) as f:
    build = json.load(f)
  assert len(rows) == build['files'][name]['rows'] >= 300
  same_python = build['python'] == sys.version.split()[0]
  docs = dict(corpus.split(lm_tasks.VAL_FRACTION)['validation']) if same_python else {}
  for r in rows:
    doc, line = r['source'].rsplit(':', 1)
    assert corpus.is_validation(doc, lm_tasks.VAL_FRACTION)  # held out (by name, any Python)
    answer = r['choices'][r['label']]
    assert len(set(r['choices'])) == 4 and all(c.endswith('\n') for c in r['choices'])
    if name == 'next_line.jsonl':  # whole lines of one indentation, after whole lines
      assert len({c[:len(c) - len(c.lstrip())] for c in r['choices']}) == 1
      assert r['context'].endswith('\n')
    else:  # line endings of one length, after a cut line
      assert len({len(c) for c in r['choices']}) == 1 and not r['context'].endswith('\n')
    if same_python:  # the context, then the answer, is the document's text up to that line
      text = '\n'.join(docs[doc].split('\n')[:int(line)]) + '\n'
      assert text.endswith(r['context'] + answer)
  if same_python:  # the committed file is the generator's output
    assert rows == lm_tasks.FILES[name]()
  assert np.bincount([r['label'] for r in rows], minlength=4).min() > len(rows) / 8
  if not same_python:  # said, not silent: the checks above passed, these could not run
    pytest.skip(f"the rows were built on Python {build['python']}, this is "
                f'{sys.version.split()[0]}: not compared with the generator or the documents')


def test_the_package_imports_without_lm_eval():
  code = ('import sys; sys.modules["lm_eval"] = None\n'
          'import loopmoe_jax, loopmoe_jax.analysis, loopmoe_jax.lm_tasks\n'
          'try:\n  import loopmoe_jax.analysis.lm_harness\nexcept ImportError as e:\n'
          '  print(e)\n')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True,
                       env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert 'pip install lm-eval==0.4.13' in out.stdout


def test_a_workdir_with_a_router_bias_scores_the_same_on_a_mesh(tmp_path):
  """A trained run directory (model.router_bias='shared': the bias read with the params) on a
  data2 x expert2 mesh gives the one-device scores: the bias follows the params onto the mesh."""
  from helpers import tiny  # pylint: disable=import-outside-toplevel
  from loopmoe_jax.train.trainer import train  # pylint: disable=import-outside-toplevel
  cfg = tiny(steps=2)
  cfg.model.router_bias = 'shared'
  train(cfg, str(tmp_path))
  mesh = sharding.make_mesh(MeshConfig(data=2, expert=2), jax.devices()[:4])
  reqs = ll_requests(PAIRS)
  one = lm_harness.LoopedMoELM(str(tmp_path), batch_size=BATCH).loglikelihood(reqs)
  on_mesh = lm_harness.LoopedMoELM(str(tmp_path), batch_size=BATCH, mesh=mesh).loglikelihood(reqs)
  np.testing.assert_allclose([lp for lp, _ in on_mesh], [lp for lp, _ in one], atol=1e-4)
