"""Each algorithm's loss and its gradient with respect to the log-probs equal TRL's
(GRPOTrainer's own loss code, run on CPU torch) on the same batch: ragged responses, clipped
and unclipped tokens, KL on and off, on- and off-policy. GRPO's two aggregations are TRL's
'bnpo' (token mean) and 'grpo' (sequence mean); DAPO is 'dapo', Dr. GRPO 'dr_grpo', GSPO
'grpo' with importance_sampling_level='sequence'. Advantages are given, the same to both."""

import collections
import types

import jax
import numpy as np
import pytest

from tlt_jax.rl.algorithms import make_algorithm
from tlt_jax.rl.loss import LossConfig

torch = pytest.importorskip("torch")
grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")

MAX_NEW_TOKENS = 100  # the response budget (Dr. GRPO's normaliser)
LENGTHS = (9, 3, 12, 1, 7, 12)  # ragged responses in a [6, 12] batch

# (our algorithm, its rl.* knobs) -> (TRL loss_type, importance_sampling_level,
# epsilon, epsilon_high)
CASES = {
    "grpo_token_mean": (("grpo", {}), ("bnpo", "token", 0.2, 0.28)),
    "grpo_sequence_mean": (("grpo", {"loss_agg": "sequence_mean"}),
                           ("grpo", "token", 0.2, 0.28)),
    "grpo_plain_clip": (("grpo", {"clip_eps_high": 0.2}), ("bnpo", "token", 0.2, 0.2)),
    "dapo": (("dapo", {}), ("dapo", "token", 0.2, 0.28)),
    "dr_grpo": (("dr_grpo", {}), ("dr_grpo", "token", 0.2, 0.28)),
    "gspo": (("gspo", {}), ("grpo", "sequence", 3e-4, 4e-4)),
}


def _batch(level: str, seed: int = 0) -> dict:
  """Log-probs [6, 12] float32 (0 off the mask), a ragged mask, mixed-sign advantages, and
  old / reference log-probs. Token ratios spread over [0.6, 1.6] (both sides of a 0.2 / 0.28
  clip); for GSPO each response's mean log-ratio is set to straddle its 3e-4 / 4e-4 range."""
  rng = np.random.default_rng(seed)
  rows, width = len(LENGTHS), max(LENGTHS)
  mask = np.arange(width)[None] < np.asarray(LENGTHS)[:, None]
  logp = np.where(mask, -rng.uniform(0.05, 4.0, (rows, width)), 0.0)
  if level == "token":
    log_ratio = rng.uniform(np.log(0.6), np.log(1.6), (rows, width))
  else:  # per response: inside, below and above [1 - 3e-4, 1 + 4e-4], as mean log-ratios
    target = np.array([1e-4, -8e-4, 9e-4, -1e-4, 2e-3, -2e-3])[:, None]
    noise = rng.normal(0, 0.05, (rows, width)) * mask
    noise -= noise.sum(1, keepdims=True) / mask.sum(1, keepdims=True) * mask
    log_ratio = target + noise
  old = np.where(mask, logp - log_ratio, 0.0)
  ref = np.where(mask, logp + rng.normal(0, 0.3, (rows, width)), 0.0)
  adv = np.array([1.2, -0.7, 0.4, -1.5, 0.9, -0.3])
  return {"logp": logp.astype(np.float32), "old_logp": old.astype(np.float32),
          "ref_logp": ref.astype(np.float32), "advantages": adv.astype(np.float32),
          "loss_mask": mask}


class _OneProcess:
  """accelerate's Accelerator as TRL's loss uses it, for one process."""
  num_processes, sync_gradients = 1, True

  def gather(self, x):
    return x

  gather_for_metrics = gather

  def reduce(self, x, reduction="sum"):
    return x


def trl_loss(batch: dict, loss_type: str, level: str, eps: float, eps_high: float,
             beta: float, on_policy: bool) -> tuple[float, np.ndarray]:
  """(loss, d loss / d logp [B, T]) of TRL's GRPOTrainer._compute_loss on `batch` (float64):
  the trainer's own code, with the model's log-probs replaced by batch['logp'] (a leaf)."""
  logp = torch.tensor(batch["logp"], dtype=torch.float64, requires_grad=True)
  mask = torch.tensor(batch["loss_mask"], dtype=torch.float64)
  trainer = types.SimpleNamespace(
      loss_type=loss_type, importance_sampling_level=level, epsilon_low=eps,
      epsilon_high=eps_high, beta=beta, max_completion_length=MAX_NEW_TOKENS,
      top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
      aux_loss_enabled=False, _entropy_bonus_enabled=False,
      current_gradient_accumulation_steps=1, accelerator=_OneProcess(),
      model=types.SimpleNamespace(training=True),
      args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None,
                                 steps_per_generation=1),
      _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
      _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None))
  rows, width = mask.shape
  inputs = {"prompt_ids": torch.zeros((rows, 0), dtype=torch.long),
            "prompt_mask": torch.zeros((rows, 0), dtype=torch.long),
            "completion_ids": torch.zeros((rows, width), dtype=torch.long),
            "completion_mask": mask,
            "advantages": torch.tensor(batch["advantages"], dtype=torch.float64),
            "ref_per_token_logps": torch.tensor(batch["ref_logp"], dtype=torch.float64),
            "num_items_in_batch": mask.sum()}
  if not on_policy:
    inputs["old_per_token_logps"] = torch.tensor(batch["old_logp"], dtype=torch.float64)
  loss = grpo_trainer.GRPOTrainer._compute_loss(trainer, None, inputs)
  loss.backward()
  return float(loss.detach()), logp.grad.numpy()


def ours(batch: dict, name: str, knobs: dict, kl_coef: float, on_policy: bool):
  """(loss, d loss / d logp, metrics) of the algorithm's policy_loss on the whole batch as
  one mini-batch (float32)."""
  algorithm = make_algorithm(name, LossConfig(kl_coef=kl_coef, **knobs), MAX_NEW_TOKENS)
  keys = ("advantages", "loss_mask") + (() if on_policy else ("old_logp",)) + \
      (("ref_logp",) if kl_coef else ())
  b = {k: batch[k] for k in keys}
  b["weight"] = algorithm.loss_weights(batch["loss_mask"])
  (loss, metrics), grad = jax.value_and_grad(
      lambda lp: algorithm.policy_loss(lp, b), has_aux=True)(batch["logp"])
  return float(loss), np.asarray(grad), jax.device_get(metrics)


@pytest.mark.parametrize("on_policy", [False, True], ids=["off_policy", "on_policy"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.04], ids=["kl_off", "kl_on"])
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_equal_trl(case, kl_coef, on_policy):
  (name, knobs), (loss_type, level, eps, eps_high) = CASES[case]
  batch = _batch(level)
  want, want_grad = trl_loss(batch, loss_type, level, eps, eps_high, kl_coef, on_policy)
  got, got_grad, metrics = ours(batch, name, knobs, kl_coef, on_policy)
  assert abs(got - want) < 1e-6, (got, want)
  assert np.abs(got_grad - want_grad).max() < 1e-6
  assert np.abs(want_grad[batch["loss_mask"]]).min() > 0 or kl_coef == 0
  assert not want_grad[~batch["loss_mask"]].any()
  if not on_policy:  # the batch has both clipped and unclipped tokens (or responses)
    assert 0.1 < float(metrics["clip_frac"]) < 0.9, metrics["clip_frac"]


@pytest.mark.parametrize("case", list(CASES))
def test_micro_batches_add_up_to_the_mini_batch_loss(case):
  """Weights computed on the whole mini-batch make the micro-batches' losses (and so their
  gradients) sum to the mini-batch's, whatever the aggregation."""
  (name, knobs), _ = CASES[case]
  batch = _batch("sequence" if name == "gspo" else "token", seed=1)
  algorithm = make_algorithm(name, LossConfig(kl_coef=0.04, **knobs), MAX_NEW_TOKENS)
  b = {k: batch[k] for k in ("advantages", "loss_mask", "old_logp", "ref_logp")}
  b["weight"] = algorithm.loss_weights(batch["loss_mask"])
  whole = float(algorithm.policy_loss(batch["logp"], b)[0])
  parts = sum(float(algorithm.policy_loss(batch["logp"][s], {k: v[s] for k, v in b.items()})[0])
              for s in (slice(0, 2), slice(2, 5), slice(5, 6)))
  assert parts == pytest.approx(whole, abs=1e-6)
