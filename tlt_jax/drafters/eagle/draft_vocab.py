"""A reduced draft vocabulary (EAGLE-3, FR-Spec): the drafter predicts over the r policy tokens
that the policy itself generates most, so a draft step reads an [E, r] head instead of the
policy's [E, V] one.

`d2t` [r] int32 holds the policy id of each draft id, in increasing policy-id order. It is a
fixed map, chosen once from the policy's own generations (the offline warm-up's responses)
and never trained. EAGLE-3's Hugging Face files store it as offsets (policy id = draft id +
d2t[draft id]) next to `t2d`, a [V] bool mask of the policy ids in the draft vocabulary;
`offsets_from_ids` / `ids_from_offsets` convert.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np


def frequent_tokens(sequences: Iterable[Iterable[int]], vocab_size: int, size: int
                    ) -> np.ndarray:
  """d2t: the `size` most frequent ids in `sequences` (ties and unseen ids by lower id),
  sorted by id. [size] int32."""
  if not 1 <= size <= vocab_size:
    raise ValueError(f"draft vocabulary size {size} must be in 1..{vocab_size} (the policy's "
                     f"vocabulary)")
  counts = np.zeros(vocab_size, np.int64)
  for seq in sequences:
    ids = np.asarray(list(seq), np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
      raise ValueError(f"token ids must lie in 0..{vocab_size - 1}, got {ids.min()}.."
                       f"{ids.max()}")
    counts += np.bincount(ids, minlength=vocab_size)
  order = np.lexsort((np.arange(vocab_size), -counts))  # most frequent first, then lower id
  return np.sort(order[:size]).astype(np.int32)


def in_draft_vocab(d2t: jax.Array, vocab_size: int) -> jax.Array:
  """t2d: [V] bool, True at the policy ids the draft vocabulary holds."""
  return jnp.zeros((vocab_size,), bool).at[d2t].set(True)


def offsets_from_ids(d2t: np.ndarray) -> np.ndarray:
  """EAGLE-3's stored d2t: policy id minus draft id. [r] int64."""
  d2t = np.asarray(d2t, np.int64)
  return d2t - np.arange(d2t.size, dtype=np.int64)


def ids_from_offsets(offsets: np.ndarray) -> np.ndarray:
  """Policy ids from EAGLE-3's stored offsets. [r] int32."""
  offsets = np.asarray(offsets, np.int64)
  return (offsets + np.arange(offsets.size, dtype=np.int64)).astype(np.int32)
