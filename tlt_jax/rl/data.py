"""Real data sets (GSM8K / MATH / DAPO-style JSON lines) as `Example`s, and a deterministic,
resumable prompt iterator (its `state_dict()` goes into checkpoints)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from tlt_jax.rl.answers import extract_boxed, extract_hash_answer
from tlt_jax.rl.tasks.example import Example, json_safe

T = TypeVar("T")

_PROMPT_KEYS = ("question", "prompt", "problem")


def _final_answer(raw: str) -> str:
  """GSM8K answers end in '#### x' and MATH/DAPO answers may be '\\boxed{x}': keep x."""
  found = extract_hash_answer(raw)
  found = extract_boxed(raw) if found is None else found
  return raw.strip() if found is None else found


def _prompt_text(value: Any, where: str) -> str:
  if isinstance(value, str):
    return value
  # DAPO/verl records carry the prompt as chat messages: keep the last user turn.
  if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
    user = [m.get("content") for m in value if m.get("role") == "user"]
    if user and isinstance(user[-1], str):
      return user[-1]
  raise ValueError(f"{where}: the prompt must be a string or a list of chat messages with a "
                   f"'user' turn, got {type(value).__name__}")


def example_from_record(record: dict, where: str = "record") -> Example:
  """One JSON record -> Example. Prompt: the first of 'question', 'prompt', 'problem'. Answer:
  'answer' (its '#### x' or '\\boxed{x}' part when present), else 'reward_model.ground_truth'
  (verl/DAPO), else the boxed answer of 'solution' (MATH); its worked solution, if any, is kept."""
  if not isinstance(record, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
  key = next((k for k in _PROMPT_KEYS if k in record), None)
  if key is None:
    raise ValueError(f"{where}: no prompt field; expected one of {_PROMPT_KEYS}, found "
                     f"{sorted(record)}")
  prompt = _prompt_text(record[key], where)
  solution = record.get("solution")
  raw = record.get("answer")
  if raw is None and isinstance(record.get("reward_model"), dict):
    raw = record["reward_model"].get("ground_truth")
  if raw is None and isinstance(solution, str):
    raw = extract_boxed(solution)
  if raw is None:
    raise ValueError(f"{where}: no answer; expected an 'answer' field (GSM8K '... #### x' or "
                     f"MATH '\\boxed{{x}}'), 'reward_model.ground_truth', or a 'solution' with "
                     f"a \\boxed answer")
  raw = str(raw)
  if solution is None and extract_hash_answer(raw) is not None:
    solution = raw  # GSM8K puts the worked solution in the answer field
  metadata = {k: v for k, v in record.items()
              if k not in (key, "answer", "solution") and json_safe(v)}
  return Example(prompt=prompt, answer=_final_answer(raw),
                 solution=solution if isinstance(solution, str) else None, metadata=metadata)


def load_examples(path: str, limit: int | None = None) -> list[Example]:
  """The examples of a data file (task.data_path / task.eval_data_path; see `load_jsonl`).
  Parquet is not read (it would need pyarrow, a large dependency). Raises FileNotFoundError
  or ValueError with one line naming the file (and the line)."""
  return [example for _, example in load_numbered_examples(path, limit)]


def load_numbered_examples(path: str, limit: int | None = None) -> list[tuple[int, Example]]:
  """(line number, Example) of each record of a data file, as `load_examples` reads it."""
  if path.endswith(".parquet"):
    raise ValueError(f"data file {path!r} is Parquet, which tlt_jax does not read; convert it "
                     f"to JSON lines, e.g. pandas.read_parquet(path).to_json(out, "
                     f"orient='records', lines=True)")
  records = list(_jsonl_records(path, limit))
  if not records:
    raise ValueError(f"data file {path!r} has no records (it is empty or blank)")
  return records


def load_jsonl(path: str, limit: int | None = None) -> list[Example]:
  """The records of a JSON-lines file (see `example_from_record`); blank lines are skipped.
  Raises FileNotFoundError for a missing file and ValueError naming the file and line of a bad
  record or of bytes that are not UTF-8."""
  return [example for _, example in _jsonl_records(path, limit)]


def _jsonl_records(path: str, limit: int | None) -> Iterator[tuple[int, Example]]:
  """(line number, Example) of each record of a JSON-lines file; blank lines are skipped."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"data file {path!r} does not exist")
  count = 0
  with open(path, "rb") as f:  # bytes: a decoding error is then tied to its line
    for lineno, raw in enumerate(f, 1):
      if limit is not None and count >= limit:  # before reading: limit=0 reads nothing
        return
      where = f"{path}:{lineno}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x}, the line's byte "
                         f"{e.start + 1}); re-encode the file as UTF-8") from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
      yield lineno, example_from_record(record, where)
      count += 1


class PromptIterator(Generic[T], Iterator[T]):
  """Endless iterator over `items`, reshuffled every epoch; resumable from `state_dict()`.

  Epoch e visits the items in the order `default_rng([seed, e]).permutation(len(items))`
  (or in order when shuffle=False), so the sequence is a pure function of (seed, position):
  restoring {"epoch", "index"} continues exactly where a run stopped."""

  def __init__(self, items: Sequence[T], seed: int = 0, shuffle: bool = True):
    if len(items) == 0:
      raise ValueError("PromptIterator needs at least one item")
    self.items, self.seed, self.shuffle = items, seed, shuffle
    self._seek(0, 0)

  def _seek(self, epoch: int, index: int) -> None:
    self.epoch, self.index = epoch, index
    self._order = (np.random.default_rng([self.seed, epoch]).permutation(len(self.items))
                   if self.shuffle else np.arange(len(self.items)))

  def __next__(self) -> T:
    if self.index >= len(self.items):
      self._seek(self.epoch + 1, 0)
    item = self.items[int(self._order[self.index])]
    self.index += 1
    return item

  def take(self, count: int) -> list[T]:
    return [next(self) for _ in range(count)]

  def state_dict(self) -> dict[str, int]:
    return {"epoch": int(self.epoch), "index": int(self.index)}

  def load_state_dict(self, state: dict) -> None:
    epoch, index = int(state["epoch"]), int(state["index"])
    if epoch < 0 or not 0 <= index <= len(self.items):
      raise ValueError(f"bad iterator state {state!r} for {len(self.items)} items: need "
                       f"epoch >= 0 and 0 <= index <= {len(self.items)}")
    self._seek(epoch, index)
