"""What a compiled program does per call and per iteration of its decode loop, counted from
its optimised HLO text (`jax.jit(f).lower(...).compile().as_text()`), without running it.

On a GPU each top-level operation of a compiled program is (about) one kernel launch: a
fusion, a cuBLAS/cuDNN custom call, a copy, a sort, a scatter that was not fused. A decode
step of a small model is bound by those launches, so their count per iteration of the
`lax.while_loop` that `decode_loop` runs is what a change to the step's bookkeeping moves.
On a CPU the compiled HLO is XLA:CPU's, not XLA:GPU's, and fuses differently, but an
operation added to every iteration (a copy of the KV cache, a sort, a full-vocabulary pass per
row) shows up in both.

Counting rules: an instruction is one operation unless it moves no data (parameters,
constants, tuples, bitcasts, ...); a fusion counts once (its body is one kernel) and so does
a custom call; a nested `while` counts its body times its known trip count (once when XLA
does not know it) and its condition once more; a `conditional` counts its largest branch;
`call`s are counted through. The loop of `decode_loop` is the top-level while of the entry
computation whose body is largest.
"""

from __future__ import annotations

import collections
import math
import re

# Opcodes that launch nothing: they rename, group or describe buffers.
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
        "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain"}
# Opcodes that only move data: a fusion of nothing else is a copy (XLA:CPU materialises a
# static slice of a stacked weight as such a fusion).
MOVES = FREE | {"copy", "slice", "transpose", "reshape", "dynamic-slice", "concatenate",
                "broadcast", "pad"}
# What `summary` names separately (the rest is in `by_opcode`).
NAMED = {"fusions": ("fusion",), "custom_calls": ("custom-call",),
         "dynamic_update_slices": ("dynamic-update-slice",), "scatters": ("scatter",),
         "sorts": ("sort",), "copies": ("copy", "copy-start"),
         "all_reduces": ("all-reduce", "all-reduce-start"),
         "all_gathers": ("all-gather", "all-gather-start"), "while_loops": ("while",),
         "conditionals": ("conditional",),
         "host_transfers": ("infeed", "outfeed", "send", "recv", "send-done", "recv-done")}
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)="
                     r"(%?[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_SHAPE = re.compile(r"^([a-z]+\d*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


class Instruction(collections.namedtuple("Instruction", "name opcode shape text")):
  """One HLO instruction: its name, opcode, result type text and whole line."""


def parse_hlo(text: str) -> tuple[dict[str, list[Instruction]], str]:
  """HLO module text -> ({computation name: its instructions}, the entry computation's name).
  Names lose their leading '%' (printed or not, depending on the XLA version)."""
  comps, entry, current = {}, None, None
  for line in text.splitlines():
    if not line.startswith(" ") and line.rstrip().endswith("{") and "(" in line:
      head = line.split("(")[0].split()
      name = head[-1].lstrip("%")
      current = comps.setdefault(name, [])
      if head[0] == "ENTRY":
        entry = name
      continue
    if current is None or " = " not in line:
      continue
    if line.strip() == "}":
      current = None
      continue
    name, _, rest = line.strip().removeprefix("ROOT ").partition(" = ")
    shape, after = _split_type(rest)
    m = re.match(r"([a-z][\w\-]*)\(", after)
    if m:
      current.append(Instruction(name.lstrip("%"), m.group(1), shape, line))
  if entry is None:
    raise ValueError("no ENTRY computation in this HLO text; pass compiled.as_text()")
  return comps, entry


def _split_type(rest: str) -> tuple[str, str]:
  """'f32[2]{0} add(...)' or '(f32[], s32[]) while(...)' -> (the type, the rest)."""
  if rest.startswith("("):
    depth = 0
    for i, c in enumerate(rest):
      depth += (c == "(") - (c == ")")
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  shape, _, after = rest.partition(" ")
  return shape, after


def callees(ins: Instruction) -> list[str]:
  """The computations an instruction calls (fusion bodies and reducers included)."""
  names = [m.group(2) for m in _CALLEE.finditer(ins.text)]
  for m in _BRANCHES.finditer(ins.text):
    names += [n.strip() for n in m.group(1).split(",")]
  return [n.lstrip("%") for n in names]


def shape_bytes(shape: str) -> tuple[tuple[int, ...], int]:
  """'f32[2,3]{1,0}' -> ((2, 3), 24); a tuple or token type -> ((), 0)."""
  m = _SHAPE.match(shape)
  if not m or m.group(1) not in _BYTES:
    return (), 0
  dims = tuple(int(d) for d in m.group(2).split(",") if d)
  return dims, _BYTES[m.group(1)] * math.prod(dims)


def count_ops(comps: dict, name: str, big: dict[str, set] | None = None,
              _memo: dict | None = None) -> collections.Counter:
  """Operations of computation `name` by opcode (see the module docstring), plus
  'custom-call:<target>' per custom call target, 'copy-of:<what>' per copy whose result has a
  shape of `big` ({'kv_cache': {shape tuples}, 'weights': {...}}) (and so each fusion that only
  moves data into such a shape), 'fused:<opcode>' for
  dynamic-update-slices, scatters and sorts inside fusions, and 'unknown-trip-while' per nested
  loop whose trip count XLA does not know."""
  memo = {} if _memo is None else _memo
  if name in memo:
    return memo[name]
  out = collections.Counter()
  for ins in comps.get(name, []):
    op = ins.opcode
    if op in FREE:
      continue
    called = callees(ins)
    if op == "fusion":
      out[op] += 1
      inner = [i for c in called for i in comps.get(c, [])]
      for i in inner:
        if i.opcode in ("dynamic-update-slice", "scatter", "sort"):
          out["fused:" + i.opcode] += 1
      if big and all(i.opcode in MOVES for i in inner):  # a copy, however XLA spelt it
        _count_copy(out, ins, big)
      continue
    if op in ("call", "async-start"):
      for c in called:
        out.update(count_ops(comps, c, big, memo))
      continue
    if op == "while":
      out[op] += 1
      body, cond = _while_parts(ins)
      trip = _TRIP.search(ins.text)
      n = int(trip.group(1)) if trip else 1
      if not trip:
        out["unknown-trip-while"] += 1
      for key, value in count_ops(comps, body, big, memo).items():
        out[key] += n * value
      for key, value in count_ops(comps, cond, big, memo).items():
        out[key] += (n + 1) * value
      continue
    if op == "conditional":
      out[op] += 1
      branches = [count_ops(comps, c, big, memo) for c in called]
      if branches:
        out.update(max(branches, key=lambda c: sum(c.values())))
      continue
    out[op] += 1
    if op == "custom-call":
      target = _TARGET.search(ins.text)
      out["custom-call:" + (target.group(1) if target else "?")] += 1
    if op in ("copy", "copy-start") and big:
      _count_copy(out, ins, big)
  memo[name] = out
  return out


def _count_copy(out: collections.Counter, ins: Instruction, big: dict[str, set]) -> None:
  dims, _ = shape_bytes(ins.shape)
  for what, shapes in big.items():
    if dims in shapes:
      out["copy-of:" + what] += 1


def _while_parts(ins: Instruction) -> tuple[str, str]:
  parts = dict(m.groups() for m in _CALLEE.finditer(ins.text))
  return parts["body"].lstrip("%"), parts["condition"].lstrip("%")


def decode_loop_counts(hlo_text: str, big: dict[str, set] | None = None) -> dict:
  """{'per_iteration': counts of one iteration of the decode loop (its body and condition),
  'per_call': counts of the rest of the program (once per call), 'loop_found'} with each
  counts dict as `summary` makes it. A program without a top-level loop has all its ops per
  call."""
  comps, entry = parse_hlo(hlo_text)
  memo = {}
  loops = [ins for ins in comps[entry] if ins.opcode == "while"]
  loop = max(loops, key=lambda ins: len(comps.get(_while_parts(ins)[0], [])), default=None)
  per_iteration = collections.Counter()
  if loop is not None:
    body, cond = _while_parts(loop)
    per_iteration = count_ops(comps, body, big, memo) + count_ops(comps, cond, big, memo)
  outside = {**comps, entry: [i for i in comps[entry] if i is not loop]}
  per_call = count_ops(outside, entry, big, {})
  return {"loop_found": loop is not None, "per_iteration": summary(per_iteration),
          "per_call": summary(per_call)}


def summary(counts: collections.Counter) -> dict:
  """{'ops': total, one entry per NAMED group, 'by_opcode': the rest, largest first}."""
  plain = {k: v for k, v in counts.items() if ":" not in k and k != "unknown-trip-while"}
  out = {"ops": sum(plain.values())}
  for key, opcodes in NAMED.items():
    out[key] = sum(plain.get(op, 0) for op in opcodes)
  out["host_callbacks"] = sum(v for k, v in counts.items()
                              if k.startswith("custom-call:") and "callback" in k)
  out["kv_cache_copies"] = counts.get("copy-of:kv_cache", 0)
  out["weight_copies"] = counts.get("copy-of:weights", 0)
  out["unknown_trip_loops"] = counts.get("unknown-trip-while", 0)
  out["fused"] = {k.split(":", 1)[1]: v for k, v in sorted(counts.items())
                  if k.startswith("fused:")}
  out["custom_call_targets"] = {k.split(":", 1)[1]: v for k, v in sorted(counts.items())
                                if k.startswith("custom-call:")}
  out["by_opcode"] = dict(sorted(plain.items(), key=lambda kv: (-kv[1], kv[0])))
  return out
