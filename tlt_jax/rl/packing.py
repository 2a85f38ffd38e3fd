"""Packing (prompt, response) token sequences into fixed [rows, seq_len] training batches.

Several sequences share a row, each with its own segment id; positions restart at 0 in every
segment, and `tlt_jax.models.attention_inputs.packed_inputs` keeps segments from attending to each other, so a packed
row computes exactly what the sequences would compute alone. Only response tokens are targets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def pack_sequences(seqs: Sequence[tuple[Sequence[int], Sequence[int]]], rows: int,
                   seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
  """Packs (prompt_ids, response_ids) pairs first-fit into rows.

  Returns numpy arrays, all [rows, seq_len]:
    tokens int32 (pad_id in free slots), targets int32 (the next token in the same segment),
    loss_mask float32 (1 where the target is a response token), positions int32 (from 0 in
    each segment), segment_ids int32 (1, 2, ... per row; 0 = padding).
  Raises ValueError when a sequence is longer than seq_len or the pairs do not all fit.
  """
  placed = _first_fit([len(p) + len(r) for p, r in seqs], rows, seq_len)
  if placed is None:
    raise ValueError(f"{len(seqs)} sequences do not fit in {rows} rows of {seq_len} tokens")
  batch = empty_batch(rows, seq_len, pad_id)
  fill = [0] * rows
  for (prompt, response), row in zip(seqs, placed):
    _write(batch, row, fill[row], prompt, response)
    fill[row] += len(prompt) + len(response)
  return batch


def _first_fit(lengths: Sequence[int], rows: int, seq_len: int) -> list[int] | None:
  fill = [0] * rows
  out = []
  for n in lengths:
    if n > seq_len:
      raise ValueError(f"a sequence of {n} tokens does not fit in sft.seq_len={seq_len}; raise "
                       f"seq_len or shorten the task (task.max_ops)")
    row = next((r for r in range(rows) if fill[r] + n <= seq_len), None)
    if row is None:
      return None
    fill[row] += n
    out.append(row)
  return out


def empty_batch(rows: int, seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
  return {"tokens": np.full((rows, seq_len), pad_id, np.int32),
          "targets": np.full((rows, seq_len), pad_id, np.int32),
          "loss_mask": np.zeros((rows, seq_len), np.float32),
          "positions": np.zeros((rows, seq_len), np.int32),
          "segment_ids": np.zeros((rows, seq_len), np.int32)}


def _write(batch, row, start, prompt, response):
  seq = np.asarray(list(prompt) + list(response), np.int32)
  n = len(seq)
  sl = slice(start, start + n)
  batch["tokens"][row, sl] = seq
  batch["targets"][row, start:start + n - 1] = seq[1:]
  # Position j predicts token j + 1, a response token when j + 1 >= len(prompt).
  mask = np.zeros(n, np.float32)
  mask[max(len(prompt) - 1, 0):n - 1] = 1.0
  batch["loss_mask"][row, sl] = mask
  batch["positions"][row, sl] = np.arange(n)
  batch["segment_ids"][row, sl] = int(batch["segment_ids"][row].max()) + 1


def next_packed_batch(iterator, encode: Callable[[Any], tuple[list[int], list[int]]], rows: int,
                      seq_len: int, pad_id: int = 0) -> tuple[dict[str, np.ndarray], int]:
  """Fills one batch from `iterator` (a PromptIterator) first-fit, stopping at the first item
  that fits in no row; that item is not consumed (the iterator is rewound to before it), so the
  iterator state after the call is exactly "everything in this batch was seen".

  Returns (batch, number of sequences packed).
  """
  batch = empty_batch(rows, seq_len, pad_id)
  fill = [0] * rows
  count = 0
  while True:
    before = iterator.state_dict()
    prompt, response = encode(next(iterator))
    n = len(prompt) + len(response)
    if n > seq_len:
      raise ValueError(f"a sequence of {n} tokens does not fit in sft.seq_len={seq_len}; raise "
                       f"seq_len or shorten the task (task.max_ops)")
    row = next((r for r in range(rows) if fill[r] + n <= seq_len), None)
    if row is None:
      iterator.load_state_dict(before)
      return batch, count
    _write(batch, row, fill[row], prompt, response)
    fill[row] += n
    count += 1
