"""The target distribution q that both plain decoding and speculative decoding sample from,
and the one way a token is drawn from it.

Speculative decoding is exact when it draws from the same q as plain decoding, so both go
through `target_probs`: temperature, then top-k, then top-p (nucleus), renormalised.
Temperature 0 is greedy: q is one-hot at the argmax. A compiled rollout program takes the
temperature as an argument (`with_temperature`), so greedy and sampled decoding at any
temperature run the same programs; only the support (top-k, top-p) is compiled in.

A token is drawn by Gumbel-max, argmax(log q + g), with noise g that depends only on (the
rollout's key, the request, the position in the response). Plain decoding and speculative
verification use the same noise for the same position, so they emit the same tokens, whatever
the drafter, the strategy, the batch or the schedule.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend.random import threefry_2x32

from tlt_jax.models.config import NUMERICS
from tlt_jax.kernels.numerics import fixed_path, invariant_log_softmax, invariant_softmax


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off; numerics: the policy's
  `ModelConfig.numerics` ("invariant": q, its log and the noise in one order for any batch
  or tree, `tlt_jax.kernels.numerics`; the decoding steps set it from the policy)."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  numerics: str = "fast"

  def __post_init__(self):
    if not isinstance(self.temperature, jax.Array) and self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.numerics not in NUMERICS:
      raise ValueError(f"numerics must be one of {NUMERICS}, got {self.numerics!r}")

  @property
  def greedy(self) -> bool:
    """Temperature 0, known before tracing. A traced temperature (`with_temperature`) is
    not greedy here: q and the draws then select greedy at run time where it is 0."""
    return not isinstance(self.temperature, jax.Array) and self.temperature == 0.0

  @property
  def program_key(self) -> tuple[int, float]:
    """What a compiled program fixes of these parameters: the support (top_k, top_p)."""
    return (self.top_k, self.top_p)

  def with_numerics(self, numerics: str) -> SamplingParams:
    """These parameters drawing with the policy's numerics."""
    return self if numerics == self.numerics else dataclasses.replace(self, numerics=numerics)

  def with_temperature(self, temperature: jax.Array) -> SamplingParams:
    """These parameters with a traced float32 scalar temperature (0 = greedy), as a
    compiled program receives it."""
    return dataclasses.replace(self, temperature=temperature)


def support_logits(logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """float32 logits [..., V] -> logits / temperature with -inf outside the top-k / top-p
  support [..., V] float32: log q up to a constant, q being what a non-greedy sp samples from.
  The trainer scores sampled tokens under this same q (tlt_jax.rl.loss.token_log_probs)."""
  t = sp.temperature
  if isinstance(t, jax.Array):  # traced: a 0 (greedy) selects the argmax in `target_probs`
    t = jnp.where(t > 0, t, 1.0)
  logits = logits.astype(jnp.float32) / t
  if sp.top_k:
    kth = jax.lax.top_k(logits, sp.top_k)[0][..., -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  if sp.top_p < 1.0:
    # Keep the smallest prefix of the sorted distribution whose mass reaches top_p
    # (the token that crosses it included).
    probs = softmax(logits, sp)
    order = jnp.argsort(-probs, axis=-1)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < sp.top_p
    keep = jnp.zeros_like(keep_sorted).at[
        tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  return logits


def target_probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """float32 logits [..., V] -> probabilities q [..., V] (float32, rows sum to 1).

  The draw's log q is the log of this q, not a log-softmax: the two round differently, and
  the tokens must stay those that q (the trainer's distribution) redraws from the same noise.
  XLA fuses the normalisation, the greedy one-hot and the log into the draw's reductions (the
  op counts of the decode programs did not move when they were taken apart)."""
  def argmax_one_hot():
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  if sp.greedy:
    return argmax_one_hot()
  q = softmax(support_logits(logits, sp), sp)
  if isinstance(sp.temperature, jax.Array):
    # A draw from one-hot q is its token whatever the noise: greedy needs no branch of its own.
    q = jnp.where(sp.temperature > 0, q, argmax_one_hot())
  return q


def softmax(logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """softmax over the last axis of float32 [..., V] with sp's numerics."""
  if sp.numerics == "invariant":
    return invariant_softmax(logits)
  return jax.nn.softmax(logits, axis=-1)


def log_softmax(logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """log_softmax over the last axis of float32 [..., V] with sp's numerics (the rollout's and
  the trainer's token log-probs)."""
  if sp.numerics == "invariant":
    return invariant_log_softmax(logits)
  return jax.nn.log_softmax(logits, axis=-1)


def _log(x: jax.Array, sp: SamplingParams) -> jax.Array:
  return fixed_path(jnp.log, x) if sp.numerics == "invariant" else jnp.log(x)


def token_noise(key: jax.Array, requests: jax.Array, positions: jax.Array,
                vocab: int, sp: SamplingParams = SamplingParams()) -> jax.Array:
  """Gumbel noise [B, P, V] (float32) for the tokens at response positions [B, P] of requests
  [B] (int32): each (request, position) pair has its own stream, derived from `key`, so a
  token's randomness never depends on the batch row, the bucket, the iteration or the strategy
  that produced it.

  Per row and position this is one threefry pass over the vocabulary (an exact Gumbel-max draw
  needs every token's noise), keyed by the request and counted by (position, block): the
  position sits in the counter rather than in a second key derivation, which would cost every
  decode iteration another threefry per row. The request's key does not change within a decode
  loop, and XLA's loop-invariant code motion lifts it out of the loop (checked in the compiled
  programs' op counts, `experiments/profile_decode.py`)."""
  half = (vocab + 1) // 2  # threefry turns each counter pair into two words

  def one(request, position):
    k = jax.random.key_data(jax.random.fold_in(key, jnp.maximum(request, 0)))
    counts = jnp.concatenate([jnp.full((half,), position, jnp.uint32),
                              jnp.arange(half, dtype=jnp.uint32)])
    return threefry_2x32(k, counts)[:vocab]
  bits = jax.vmap(jax.vmap(one, in_axes=(None, 0)))(requests, positions)
  return _gumbel_from_bits(bits, sp)


def _gumbel_from_bits(bits: jax.Array, sp: SamplingParams) -> jax.Array:
  """Standard Gumbel noise from uniform uint32 bits, as jax.random.gumbel makes it: the top 23
  bits as a float in [1, 2), shifted to a uniform in [tiny, 1), then -log(-log(u))."""
  tiny = jnp.finfo(jnp.float32).tiny
  one_to_two = jax.lax.bitcast_convert_type(
      jax.lax.shift_right_logical(bits, jnp.uint32(9)) | jnp.uint32(0x3F800000), jnp.float32)
  u = jnp.maximum(tiny, (one_to_two - 1.0) * (1.0 - tiny) + tiny)
  return -_log(-_log(u, sp), sp)


def gumbel_max(probs: jax.Array, noise: jax.Array | None,
               sp: SamplingParams = SamplingParams()) -> jax.Array:
  """argmax(log q + g) over the last axis: an exact sample from q for Gumbel noise g, the
  argmax of q for noise None (greedy). Zero-probability tokens are never drawn. [...] int32."""
  if noise is None:
    return jnp.argmax(probs, axis=-1).astype(jnp.int32)
  scores = jnp.where(probs > 0, _log(jnp.maximum(probs, 1e-38), sp) + noise, -jnp.inf)
  return jnp.argmax(scores, axis=-1).astype(jnp.int32)


def sample_tokens(probs: jax.Array, key: jax.Array, requests: jax.Array, positions: jax.Array,
                  sp: SamplingParams) -> jax.Array:
  """The token at response position positions[b] of request requests[b]: [B] int32 from
  probs [B, V] (see `target_probs`); the argmax when sp is greedy."""
  noise = None if sp.greedy else token_noise(key, requests, positions[:, None],
                                             probs.shape[-1], sp)[:, 0]
  return gumbel_max(probs, noise, sp)
