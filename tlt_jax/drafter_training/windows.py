"""Packing samples (tokens + policy features) into fixed-length windows, host side."""

from __future__ import annotations

import dataclasses

import numpy as np

from tlt_jax.drafter_training.loss import Windows


@dataclasses.dataclass
class Sample:
  """One sequence for drafter training.

  tokens [n] int; features [n, F] the policy's features of each token; train_from: first
  slot whose prediction is trained (e.g. the last prompt token, whose feature predicts the
  first response token).
  """
  tokens: np.ndarray
  features: np.ndarray
  train_from: int = 0


def pack_windows(samples: list[Sample], window: int, rows: int | None = None) -> Windows:
  """First-fit packing into rows of `window` slots; longer samples are cut into chunks.

  Each sample (or chunk) becomes its own segment with positions from 0; a chunk restarts the
  feature history, which costs it a little context but never mixes samples. Returns numpy
  arrays in a Windows (rows given: exactly that many rows, dropping what does not fit).
  """
  if not samples:
    raise ValueError("no samples to pack")
  width = samples[0].features.shape[-1]
  chunks = []
  for s in samples:
    n = len(s.tokens)
    if s.features.shape != (n, width):
      raise ValueError(f"sample features {s.features.shape} do not match {n} tokens x {width}")
    for start in range(0, n, window):
      stop = min(n, start + window)
      chunks.append((s, start, stop))
  chunks.sort(key=lambda c: c[2] - c[1], reverse=True)
  fill: list[int] = []
  placed: list[list[tuple]] = []
  for c in chunks:
    size = c[2] - c[1]
    for r, used in enumerate(fill):
      if used + size <= window:
        placed[r].append(c)
        fill[r] += size
        break
    else:
      fill.append(size)
      placed.append([c])
  n_rows = len(placed) if rows is None else rows
  tokens = np.zeros((n_rows, window), np.int32)
  features = np.zeros((n_rows, window, width), np.float32)
  segment_ids = np.zeros((n_rows, window), np.int32)
  positions = np.zeros((n_rows, window), np.int32)
  loss_mask = np.zeros((n_rows, window), bool)
  for r, row in enumerate(placed[:n_rows]):
    at = 0
    for seg, (s, start, stop) in enumerate(row, start=1):
      size = stop - start
      sl = slice(at, at + size)
      tokens[r, sl] = s.tokens[start:stop]
      features[r, sl] = s.features[start:stop]
      segment_ids[r, sl] = seg
      positions[r, sl] = np.arange(size)
      loss_mask[r, sl] = np.arange(start, stop) >= s.train_from
      at += size
  return Windows(tokens=tokens, features=features, segment_ids=segment_ids, positions=positions,
                 loss_mask=loss_mask)
