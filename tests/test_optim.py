"""The one optimizer: its schedule (warm-up, cosine decay), clipping, and named errors."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tlt_jax.optim import AdamWConfig, make_adamw


def test_schedule_warms_up_then_holds_or_decays():
  hold = AdamWConfig(learning_rate=1e-3, lr_warmup_steps=4).schedule()
  np.testing.assert_allclose([hold(s) for s in (0, 1, 2, 3, 4, 100)],
                             [2e-4, 4e-4, 6e-4, 8e-4, 1e-3, 1e-3], rtol=1e-6)
  decay = AdamWConfig(learning_rate=1e-3, lr_warmup_steps=4, decay_steps=20,
                      end_lr_fraction=0.1).schedule()
  assert decay(0) == pytest.approx(2e-4)
  assert decay(4) == pytest.approx(1e-3)
  assert decay(20) == pytest.approx(1e-4)
  assert 1e-4 < decay(12) < 1e-3
  assert AdamWConfig(learning_rate=1e-3).schedule() == 1e-3  # no warm-up: constant


@pytest.mark.parametrize("decay_steps", [0, 20])
def test_the_first_update_of_a_warm_up_trains(decay_steps):
  """Warm-up starts one increment above 0: update 0 moves the weights (Adam's first step is
  lr * sign(g)), and the peak comes at update lr_warmup_steps."""
  oc = AdamWConfig(learning_rate=1e-2, lr_warmup_steps=4, decay_steps=decay_steps)
  tx = make_adamw(oc)
  params = {"w": jnp.zeros(2)}
  updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], -1e-2 / 5, rtol=1e-4)
  assert oc.schedule()(4) == pytest.approx(1e-2)


def test_clipping_bounds_the_first_step():
  params = {"w": jnp.zeros(4)}
  grads = {"w": jnp.full(4, 100.0)}
  for clip, expect in ((0.0, 1e-2), (1.0, 1e-2)):  # Adam's first step is lr * sign(g) ...
    tx = make_adamw(AdamWConfig(learning_rate=1e-2, grad_clip=clip))
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -expect, rtol=1e-4)
  tx = make_adamw(AdamWConfig(learning_rate=1e-2, weight_decay=0.5),
                  decay_mask=lambda p: {"w": False})  # ... and decay skips masked leaves
  updates, _ = tx.update({"w": jnp.zeros(4)}, tx.init({"w": jnp.ones(4)}), {"w": jnp.ones(4)})
  np.testing.assert_allclose(updates["w"], 0.0)
  assert isinstance(tx, optax.GradientTransformation)


@pytest.mark.parametrize("kwargs,match", [
    (dict(learning_rate=0.0, section="rl"), "rl.learning_rate=0.0 must be positive"),
    (dict(learning_rate=1e-3, grad_clip=-1.0, section="rl"), "rl.grad_clip=-1.0 must be >= 0"),
    (dict(learning_rate=1e-3, b2=1.0, section="sft"), r"sft.b2=1.0 must be in \[0, 1\)"),
    (dict(learning_rate=1e-3, lr_warmup_steps=20, decay_steps=10, section="sft"),
     "sft.lr_warmup_steps=20 must be < sft.steps=10"),
])
def test_bad_values_name_the_key(kwargs, match):
  with pytest.raises(ValueError, match=match):
    AdamWConfig(**kwargs)
