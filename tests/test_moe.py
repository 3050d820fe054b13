"""Router, aux losses and the MoE module against numpy references.

- `route`: top-k of the softmax over all experts, renormalised over the k chosen (Mixtral)
  or the raw probabilities; always float32, also for bfloat16 logits.
- Load-balance loss == E * sum_i f_i P_i (numpy); == 1 for uniform router probabilities.
  It is NOT bounded below by 1 for top-k routing (a counterexample is pinned below); what
  holds is that routing every token to one expert costs E * P_max, above the uniform value.
- z-loss == mean_t logsumexp(z_t)^2.
- `MoE` with dispatch 'tiled' == dispatch 'reference' in outputs, aux losses and every
  parameter gradient, also with an idle expert and with every token sent to one expert.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopmoe_jax.config import ModelConfig
from loopmoe_jax.moe import MoE, load_balance_loss, route, z_loss
from loopmoe_jax.runtime import Runtime


def softmax64(z):
  z = np.asarray(z, np.float64)
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def route_numpy(logits, k, renormalize):
  """Per token: sort the probabilities, keep the k largest (ties to the lower index)."""
  p = softmax64(logits)
  experts = np.stack([np.argsort(-row, kind='stable')[:k] for row in p])
  weights = np.take_along_axis(p, experts, -1)
  if renormalize:
    weights = weights / weights.sum(-1, keepdims=True)
  return experts, weights, p


def lb_numpy(experts, probs):
  t, k = experts.shape
  e = probs.shape[1]
  f = np.array([np.sum(experts == i) for i in range(e)]) / (t * k)
  return e * np.sum(f * np.asarray(probs, np.float64).mean(0))


# route ------------------------------------------------------------------------------------

@pytest.mark.parametrize('renormalize', [True, False])
@pytest.mark.parametrize('tokens,experts,k,seed', [(16, 8, 2, 0), (9, 5, 1, 1), (12, 6, 3, 2),
                                                   (7, 4, 4, 3)])
def test_route_matches_numpy(tokens, experts, k, seed, renormalize):
  rng = np.random.default_rng(seed)
  logits = rng.standard_normal((tokens, experts)) * 2.0
  ex, w, p = route(jnp.asarray(logits, jnp.float32), k, renormalize)
  want_ex, want_w, want_p = route_numpy(logits, k, renormalize)
  np.testing.assert_array_equal(np.asarray(ex), want_ex)
  np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(p), want_p, rtol=1e-5, atol=1e-7)
  if renormalize:
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)
  else:  # the raw softmax probabilities of the chosen experts
    np.testing.assert_array_equal(np.asarray(w), np.take_along_axis(np.asarray(p), np.asarray(ex), -1))
    if k < experts:
      assert np.all(np.asarray(w).sum(-1) < 1.0)
  # The chosen experts are the k most probable ones.
  kth = np.sort(want_p, -1)[:, -k]
  assert np.all(np.take_along_axis(want_p, np.asarray(ex), -1) >= kth[:, None] - 1e-12)


def test_route_is_float32_for_bfloat16_logits():
  rng = np.random.default_rng(5)
  logits_bf = jnp.asarray(rng.standard_normal((32, 8)) * 3, jnp.bfloat16)
  ex, w, p = route(logits_bf, 2, True)
  assert w.dtype == jnp.float32 and p.dtype == jnp.float32
  # The softmax of the bf16 values, computed in float32 (bf16 math would miss by ~1e-3).
  want_ex, want_w, want_p = route_numpy(np.asarray(logits_bf.astype(jnp.float32)), 2, True)
  np.testing.assert_allclose(np.asarray(p), want_p, rtol=2e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(w), want_w, rtol=2e-6, atol=1e-7)
  assert z_loss(logits_bf).dtype == jnp.float32


def test_moe_router_logits_are_float32_for_bfloat16_inputs():
  """Inside the MoE module the router runs in float32 on bf16 activations."""
  cfg = ModelConfig(d_model=16, num_heads=2, expert_width=8, top_k=2, dtype='bfloat16')
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.standard_normal((2, 8, 16)), jnp.bfloat16)
  moe = MoE(cfg, 4, record=True, runtime=Runtime.of(dispatch='reference'))
  params = init_params(moe, x, 0)
  y, stats = jax.jit(moe.apply)(params, x)
  assert y.dtype == jnp.bfloat16
  assert stats['logits'].dtype == jnp.float32
  router = np.asarray(params['params']['router'].unbox(), np.float64)
  want = np.asarray(x.astype(jnp.float32), np.float64).reshape(-1, 16) @ router
  np.testing.assert_allclose(np.asarray(stats['logits']).reshape(-1, 4), want, rtol=1e-5,
                             atol=1e-6)
  want_ex, _, _ = route_numpy(want, 2, True)
  np.testing.assert_array_equal(np.asarray(stats['experts']).reshape(-1, 2), want_ex)


# Aux losses -------------------------------------------------------------------------------

@pytest.mark.parametrize('seed', range(6))
def test_load_balance_loss_matches_numpy(seed):
  rng = np.random.default_rng(seed)
  experts = int(rng.integers(2, 10))
  k = int(rng.integers(1, experts + 1))
  logits = rng.standard_normal((int(rng.integers(1, 40)), experts)) * rng.uniform(0.2, 4)
  ex, _, p = route(jnp.asarray(logits, jnp.float32), k, True)
  want = lb_numpy(np.asarray(ex), softmax64(logits))
  np.testing.assert_allclose(float(load_balance_loss(ex, p)), want, rtol=1e-5)


def test_load_balance_loss_counts_every_choice_with_weight_one_over_tk():
  """f_i counts choices, not weights: permuting a token's k choices changes nothing, and
  moving one choice from expert a to b changes the loss by E (P_b - P_a) / (T k)."""
  probs = jnp.asarray(softmax64(np.random.default_rng(0).standard_normal((5, 4))), jnp.float32)
  ex = jnp.asarray([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]], jnp.int32)
  base = float(load_balance_loss(ex, probs))
  assert float(load_balance_loss(ex[:, ::-1], probs)) == pytest.approx(base, rel=1e-6)
  moved = ex.at[4, 1].set(1)  # one choice from expert 2 to expert 1
  p_mean = np.asarray(probs, np.float64).mean(0)
  want = base + 4 * (p_mean[1] - p_mean[2]) / 10
  assert float(load_balance_loss(moved, probs)) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize('experts,k', [(8, 1), (8, 2), (4, 4), (16, 3)])
def test_load_balance_loss_uniform_routing_is_one(experts, k):
  # Equal logits: every probability is exactly 1/E, so the loss is sum_i f_i = 1 whatever
  # experts the tie-break picks.
  tokens = 2 * experts
  ex, _, p = route(jnp.zeros((tokens, experts)), k, True)
  assert float(load_balance_loss(ex, p)) == 1.0
  # Balanced choices and uniform mean probabilities: token t prefers expert t mod E and the
  # rows are cyclic shifts of one vector, so every f_i = P_i = 1/E.
  row = np.linspace(3.0, 0.0, experts)
  logits = np.stack([np.roll(row, t) for t in range(tokens)])
  ex, _, p = route(jnp.asarray(logits, jnp.float32), k, True)
  counts = np.bincount(np.asarray(ex).ravel(), minlength=experts)
  assert np.all(counts == counts[0])
  np.testing.assert_allclose(np.asarray(p).mean(0), 1 / experts, rtol=1e-6)
  assert float(load_balance_loss(ex, p)) == pytest.approx(1.0, abs=1e-6)


def test_load_balance_loss_is_not_bounded_below_by_one():
  """Mathematical fact, checked so nobody asserts '>= 1': with top-1, two tokens split
  0.51/0.49 and one token sure of expert 1 give f = (2/3, 1/3), P ~ (0.34, 0.66) and a loss
  of 2 (2/3 * 0.34 + 1/3 * 0.66) ~ 0.893."""
  probs = np.array([[0.51, 0.49], [0.51, 0.49], [1e-6, 1 - 1e-6]])
  ex, _, p = route(jnp.asarray(np.log(probs), jnp.float32), 1, True)
  np.testing.assert_array_equal(np.asarray(ex).ravel(), [0, 0, 1])
  value = float(load_balance_loss(ex, p))
  assert value == pytest.approx(lb_numpy(np.asarray(ex), probs), rel=1e-5)
  assert value < 0.9


@pytest.mark.parametrize('seed', range(8))
def test_load_balance_loss_collapse_costs_more_than_uniform(seed):
  """Every token's top-1 on one expert j: f = e_j, so the loss is E * P_j, where P_j is the
  largest mean probability, hence > 1 = the uniform value."""
  rng = np.random.default_rng(seed)
  experts, tokens = int(rng.integers(2, 12)), int(rng.integers(1, 30))
  j = int(rng.integers(experts))
  logits = rng.standard_normal((tokens, experts))
  logits[:, j] = logits.max(-1) + rng.uniform(0.1, 3.0, tokens)  # j wins every token
  ex, _, p = route(jnp.asarray(logits, jnp.float32), 1, True)
  assert np.all(np.asarray(ex) == j)
  probs = softmax64(logits)
  value = float(load_balance_loss(ex, p))
  assert value == pytest.approx(experts * probs[:, j].mean(), rel=1e-5)
  # P_j is the largest mean probability (j has the top probability on every token).
  assert probs[:, j].mean() == pytest.approx(probs.mean(0).max(), rel=1e-12)
  assert value > 1.0


@pytest.mark.parametrize('seed', range(3))
def test_z_loss_matches_numpy(seed):
  rng = np.random.default_rng(seed)
  logits = rng.standard_normal((13, 7)) * 5 + rng.normal(0, 3)
  m = logits.max(-1)
  lse = m + np.log(np.exp(logits - m[:, None]).sum(-1))
  np.testing.assert_allclose(float(z_loss(jnp.asarray(logits, jnp.float32))), np.mean(lse ** 2),
                             rtol=1e-5)


# The MoE module ---------------------------------------------------------------------------

def init_params(module, x, seed):
  """Random params in the module's own (boxed) tree, drawn in numpy with a 1/sqrt(fan-in)
  scale: jax.eval_shape of init gives the structure without compiling the initialisers."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(module.init, jax.random.key(0), x)
  return jax.tree.map(
      lambda s: jnp.asarray(rng.standard_normal(s.shape) / np.sqrt(s.shape[-2]), s.dtype), shapes)


def _force_routing(params, x, experts, mode):
  """Makes feature 0 of x a constant 1 and uses router row 0 as a per-expert bias:
  'idle' -> expert 1 never in the top-k; 'one' -> expert 2 first for every token."""
  x = x.at[..., 0].set(1.0)
  router = params['params']['router']
  value = router.unbox() * 0.05  # the data-dependent logits stay within +-1
  bias = np.zeros(experts, np.float32)
  if mode == 'idle':
    bias[1] = -8.0
  elif mode == 'one':
    bias[2] = 8.0
  value = value.at[0].set(jnp.asarray(bias))
  params = jax.tree.map(lambda a: a, params)
  params['params']['router'] = router.replace_boxed(value)
  return params, x


MOE_CASES = [
    # (experts, top_k, mode, renormalize, shared, tile)
    (6, 2, 'random', True, 0, 8),
    (6, 2, 'idle', True, 0, 8),
    (5, 1, 'idle', False, 0, 4),
    (4, 1, 'one', True, 0, 8),
    (4, 2, 'one', True, 1, 8),
    (8, 3, 'random', False, 1, 64),
]


@pytest.mark.parametrize('experts,top_k,mode,renormalize,shared,tile', MOE_CASES)
def test_moe_tiled_equals_reference(experts, top_k, mode, renormalize, shared, tile):
  d = 16
  cfg = ModelConfig(d_model=d, num_heads=2, expert_width=12, top_k=top_k,
                    renormalize=renormalize, num_shared_experts=shared,
                    prelude_experts=experts, core_experts=experts, coda_experts=experts)
  runtime = Runtime.of(dispatch='reference', dispatch_tile=tile)
  rng = np.random.default_rng(experts * 10 + top_k)
  x = jnp.asarray(rng.standard_normal((2, 7, d)), jnp.float32)
  params = init_params(MoE(cfg, experts, runtime=runtime), x, experts)
  if mode != 'random':
    params, x = _force_routing(params, x, experts, mode)
  ct = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

  def run(dispatch_name):
    moe = MoE(cfg, experts, record=True, runtime=runtime.with_run(dispatch=dispatch_name))

    def objective(p, x):
      y, stats = moe.apply(p, x)
      return jnp.sum(y * ct) + stats['load_balance'] + stats['z_loss'], (y, stats)

    return jax.jit(jax.grad(objective, argnums=(0, 1), has_aux=True))(params, x)

  (g_ref, gx_ref), (y_ref, s_ref) = run('reference')
  (g, gx), (y, s) = run('tiled')

  chosen = np.asarray(s_ref['experts']).reshape(-1, top_k)
  counts = np.bincount(chosen.ravel(), minlength=experts)
  if mode == 'idle':
    assert counts[1] == 0
  if mode == 'one':
    assert np.all(chosen[:, 0] == 2)
  np.testing.assert_array_equal(np.asarray(s['experts']), np.asarray(s_ref['experts']))
  np.testing.assert_array_equal(np.asarray(s['load']), counts)  # choices per expert

  def close(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b)) + 1e-12, what

  close(y, y_ref, 'y')
  close(gx, gx_ref, 'd_x')
  for name in ('load_balance', 'z_loss'):
    close(s[name], s_ref[name], name)
  flat_ref = dict(jax.tree_util.tree_flatten_with_path(g_ref)[0])
  flat = dict(jax.tree_util.tree_flatten_with_path(g)[0])
  assert flat.keys() == flat_ref.keys()
  for path, ref in flat_ref.items():
    close(flat[path], ref, jax.tree_util.keystr(path))
  # The router learns through the combine weights; an idle expert's weights learn nothing.
  router_grad = np.asarray(g['params']['router'].unbox())
  assert np.max(np.abs(router_grad)) > 0
  for name in ('gate', 'up', 'down'):
    expert_grad = np.asarray(g['params'][name].unbox())
    for e in range(experts):
      assert (np.max(np.abs(expert_grad[e])) > 0) == (counts[e] > 0), (name, e)


def test_moe_output_equals_per_token_numpy():
  """The whole layer (router, top-k, renormalise, experts, combine) against numpy."""
  experts, k, d, f = 5, 2, 8, 6
  cfg = ModelConfig(d_model=d, num_heads=2, expert_width=f, top_k=k,
                    prelude_experts=experts, core_experts=experts, coda_experts=experts)
  moe = MoE(cfg, experts, runtime=Runtime.of(dispatch='tiled', dispatch_tile=4))
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.standard_normal((3, 5, d)), jnp.float32)
  params = init_params(moe, x, 1)
  y, stats = jax.jit(moe.apply)(params, x)
  p = {n: np.asarray(v.unbox(), np.float64) for n, v in params['params'].items()}
  xt = np.asarray(x, np.float64).reshape(-1, d)
  logits = xt @ p['router']
  ex, w, probs = route_numpy(logits, k, True)
  want = np.zeros_like(xt)
  for t in range(xt.shape[0]):
    for j in range(k):
      e = ex[t, j]
      g = xt[t] @ p['gate'][e]
      want[t] += w[t, j] * ((g / (1 + np.exp(-g)) * (xt[t] @ p['up'][e])) @ p['down'][e])
  np.testing.assert_allclose(np.asarray(y).reshape(-1, d), want, rtol=1e-4, atol=1e-5)
  assert float(stats['load_balance']) == pytest.approx(lb_numpy(ex, probs), rel=1e-5)
  lse = np.log(np.exp(logits).sum(-1))
  assert float(stats['z_loss']) == pytest.approx(np.mean(lse ** 2), rel=1e-5)
