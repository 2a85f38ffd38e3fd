"""Packing samples (tokens + policy features) into fixed-length windows.

The plan (which chunk of which sample goes where) is made on the host from lengths alone;
the token-side arrays are small and built on the host too. Features are filled either from
host arrays (`pack_windows`, offline warm-up) or gathered on device from feature blocks
(`tlt_jax.drafter_training.buffer`), so both paths share one packing rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tlt_jax.drafters.base import Windows

Chunk = tuple[int, int, int]  # (sample index, start, stop)


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


def plan_windows(lengths: Sequence[int], window: int) -> list[list[Chunk]]:
  """First-fit packing of samples of these lengths into rows of `window` slots, longest
  chunks first; samples longer than a window are cut into chunks. Returns the rows."""
  if window < 1:
    raise ValueError(f"window must be >= 1, got {window}")
  chunks = [(i, start, min(n, start + window)) for i, n in enumerate(lengths)
            for start in range(0, n, window)]
  chunks.sort(key=lambda c: c[2] - c[1], reverse=True)
  fill: list[int] = []
  rows: list[list[Chunk]] = []
  for c in chunks:
    size = c[2] - c[1]
    for r, used in enumerate(fill):
      if used + size <= window:
        rows[r].append(c)
        fill[r] += size
        break
    else:
      fill.append(size)
      rows.append([c])
  return rows


def window_arrays(plan: list[list[Chunk]], tokens: Sequence[np.ndarray],
                  train_from: Sequence[int], window: int, rows: int) -> dict[str, np.ndarray]:
  """Host arrays [rows, window] of the plan's first `rows` rows (empty rows pad).

  Returns tokens, segment_ids (1, 2, ... per chunk, 0 = padding), positions (restart at 0 per
  chunk), loss_mask, and where each slot's feature comes from: `source` (sample index, -1 for
  padding) and `offset` (token index within that sample).
  """
  out = {"tokens": np.zeros((rows, window), np.int32),
         "segment_ids": np.zeros((rows, window), np.int32),
         "positions": np.zeros((rows, window), np.int32),
         "loss_mask": np.zeros((rows, window), bool),
         "source": np.full((rows, window), -1, np.int32),
         "offset": np.zeros((rows, window), np.int32)}
  for r, row in enumerate(plan[:rows]):
    at = 0
    for seg, (i, start, stop) in enumerate(row, start=1):
      sl = slice(at, at + stop - start)
      idx = np.arange(start, stop)
      out["tokens"][r, sl] = tokens[i][start:stop]
      out["segment_ids"][r, sl] = seg
      out["positions"][r, sl] = idx - start
      out["loss_mask"][r, sl] = idx >= train_from[i]
      out["source"][r, sl] = i
      out["offset"][r, sl] = idx
      at += stop - start
  return out


def pack_windows(samples: list[Sample], window: int, rows: int | None = None) -> Windows:
  """Packs host samples into a Windows of numpy arrays (rows given: exactly that many rows,
  dropping what does not fit).

  Each sample (or chunk) becomes its own segment with positions from 0; a chunk restarts the
  feature history, which costs it a little context but never mixes samples.
  """
  if not samples:
    raise ValueError("no samples to pack")
  width = samples[0].features.shape[-1]
  for s in samples:
    if s.features.shape != (len(s.tokens), width):
      raise ValueError(f"sample features {s.features.shape} do not match {len(s.tokens)} "
                       f"tokens x {width}")
  plan = plan_windows([len(s.tokens) for s in samples], window)
  a = window_arrays(plan, [s.tokens for s in samples], [s.train_from for s in samples], window,
                    len(plan) if rows is None else rows)
  features = np.zeros(a["tokens"].shape + (width,), np.float32)
  for r, c in zip(*np.nonzero(a["source"] >= 0)):
    features[r, c] = samples[a["source"][r, c]].features[a["offset"][r, c]]
  return Windows(tokens=a["tokens"], features=features, segment_ids=a["segment_ids"],
                 positions=a["positions"], loss_mask=a["loss_mask"])
