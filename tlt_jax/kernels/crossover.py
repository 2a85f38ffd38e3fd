"""Measured kernel-vs-reference crossovers that steer `prefix_tree_attention(impl="auto")`.

`experiments/bench_tree_attention.py --write-crossovers PATH` records, for every grid point
(B, S, T) of a benchmark run on one device kind and dtype, whether the Pallas kernel beat the
jnp reference (and gave correct, finite output). The dispatcher reads `DEFAULT_TABLE_PATH`
(`crossover.json` next to this module) when it exists; no table ships today, so `impl="auto"`
uses its fallback rule everywhere until someone measures one on a GPU and commits it.

File format (JSON):

  {"tables": [{"device_kind": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16",
               "source": {...benchmark config...},
               "entries": [{"batch": 1, "prefix_len": 1024, "tree_size": 8,
                            "kernel_wins": true, "speedup": 2.6}, ...]}]}

A table applies to its exact device kind and dtype. Within it, a shape falls into the bucket of
the smallest measured value >= it on each axis (B, S, T), or of the largest measured value when it
is beyond the grid: an entry measured at S=4096 covers capacities 2049..4096 when S=2048 was also
measured. S is the cache capacity, the only length known when the call is traced.
"""

from __future__ import annotations

import bisect
import functools
import json
import pathlib
from collections.abc import Iterable, Mapping

DEFAULT_TABLE_PATH = pathlib.Path(__file__).with_name("crossover.json")
_AXES = ("batch", "prefix_len", "tree_size")


def bucket(value: int, edges: Iterable[int]) -> int:
  """Smallest edge >= value, or the largest edge when value exceeds all of them."""
  edges = sorted(set(edges))
  i = bisect.bisect_left(edges, value)
  return edges[min(i, len(edges) - 1)]


def find_table(tables: Iterable[Mapping], device_kind: str, dtype: str) -> Mapping | None:
  """The last table for exactly this device kind and dtype name, or None."""
  found = None
  for table in tables:
    if table.get("device_kind") == device_kind and table.get("dtype") == dtype:
      found = table
  return found


def kernel_wins(tables: Iterable[Mapping], device_kind: str, dtype: str, batch: int,
                prefix_len: int, tree_size: int) -> bool | None:
  """Whether the measured table says the kernel beats the reference for this shape.

  Args:
    tables: parsed tables (the "tables" list of a crossover file).
    device_kind: `jax.Device.device_kind`, e.g. "NVIDIA H100 80GB HBM3".
    dtype: dtype name of the attention inputs, e.g. "bfloat16".
    batch, prefix_len, tree_size: B, cache capacity S and T of the call.

  Returns:
    True / False from the table entry of the shape's bucket; None when no table matches the
    device kind and dtype, or the table has no entry for that bucket (the caller then falls back
    to its own rule).
  """
  table = find_table(tables, device_kind, dtype)
  if table is None or not table.get("entries"):
    return None
  entries = table["entries"]
  key = tuple(bucket(value, (e[axis] for e in entries))
              for axis, value in zip(_AXES, (batch, prefix_len, tree_size)))
  for entry in entries:
    if tuple(entry[axis] for axis in _AXES) == key:
      return bool(entry["kernel_wins"])
  return None


def table_from_results(results: Iterable[Mapping], device_kind: str, dtype: str,
                       source: Mapping | None = None) -> dict:
  """A crossover table from benchmark result rows.

  Args:
    results: rows with batch, prefix_len, tree_size, kernel_ms, kernel_status, reference_ms,
      reference_status and kernel_correct (as `bench_tree_attention.py` writes them).
    device_kind, dtype: what the rows were measured on.
    source: free-form provenance stored with the table (benchmark config, jax version).

  Returns:
    {"device_kind", "dtype", "source", "entries"}. A point enters the table only when the kernel
    ran; it wins when its output was correct and it beat the reference, or the reference failed
    (e.g. out of memory). Points where the kernel did not run are left out, so lookups there
    fall back to the dispatcher's rule.
  """
  entries = []
  for r in results:
    if r.get("kernel_status") != "ok":
      continue
    ref_ok = r.get("reference_status") == "ok"
    faster = not ref_ok or r["kernel_ms"] < r["reference_ms"]
    entries.append(dict(batch=r["batch"], prefix_len=r["prefix_len"], tree_size=r["tree_size"],
                        kernel_wins=bool(r.get("kernel_correct")) and faster,
                        speedup=r["reference_ms"] / r["kernel_ms"] if ref_ok else None))
  return dict(device_kind=device_kind, dtype=dtype, source=dict(source or {}), entries=entries)


def merge_tables(doc: Mapping | None, table: Mapping) -> dict:
  """`doc` (a crossover file's content, or None) with `table` replacing any table of the same
  device kind and dtype."""
  tables = [t for t in (doc or {}).get("tables", [])
            if (t.get("device_kind"), t.get("dtype")) != (table["device_kind"], table["dtype"])]
  return dict(tables=[*tables, dict(table)])


@functools.lru_cache(maxsize=8)
def load_tables(path: str | pathlib.Path = DEFAULT_TABLE_PATH) -> tuple:
  """The tables of a crossover file; () when the file does not exist. Read once per path."""
  path = pathlib.Path(path)
  if not path.exists():
    return ()
  return tuple(json.loads(path.read_text()).get("tables", ()))
