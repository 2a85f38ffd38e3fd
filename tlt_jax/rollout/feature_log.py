"""The policy's features of finished sequences, gathered on device as a rollout runs.

With feature logging on, every row of a slice's GenState carries `feature_log` [B, C, F]: the
policy's feature of each committed token, written by the same compiled calls that decode. When
a logged row finishes, one small program copies its log row into the slice's store [M, C, F]
(donated, updated in place), so the features never leave the slice's devices. When the slice
runs out of work, its store and the matching token ids form a FeatureBlock, the unit that the
drafter's feature buffer keeps.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass
class FeatureBlock:
  """Logged features of one slice's finished sequences in one rollout.

  features: [M, C, F] on the slice's devices; row i < len(request_ids) holds request
    request_ids[i]: slot j is the policy's feature of sequences[i][j] for every token but the
    last (the last token was emitted, never fed back). Rows past len(request_ids) are padding.
  sequences: prompt + completion token ids (int32 numpy) per row.
  prompt_lens: prompt length per row.
  """
  features: jax.Array
  request_ids: list[int]
  sequences: list[np.ndarray]
  prompt_lens: list[int]

  def __len__(self) -> int:
    return len(self.request_ids)


def store_rows(store: jax.Array, log: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
  """store [M, C, F] with rows dst [K] set to log [B, C, F] rows src [K]; dst >= M drops."""
  return store.at[dst].set(log[src].astype(store.dtype), mode="drop")
