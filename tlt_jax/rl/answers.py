"""Final-answer extraction and equivalence for math-style completions.

Extraction: the answer stated last, in either format (so a markdown "#### heading" before a
box does not hide the box):
  - GSM8K: a line "#### x" (exactly four #; `extract_hash_answer`);
  - MATH / DAPO: `\\boxed{x}` or `\\fbox{x}`, nested braces allowed (`extract_boxed`);
  - only when asked (`extract_answer(text, fallback=True)`): the last number in the text
    (`extract_last_number`). The rewards and evaluation leave it off, so a response that skips
    the answer format earns nothing for a number it happens to end on.
Equivalence (`answers_match`) compares exact rationals when both sides parse as numbers (signs,
thousands commas, decimals, `a/b`, `\\frac{a}{b}` / `\\dfrac` / `\\tfrac`, a trailing `.0`,
`$`, whitespace, `\\text{}` wrappers and markdown emphasis are handled), and normalised strings
otherwise.
Answers are compared units-free: a unit after the number is not understood.
"""

from __future__ import annotations

import re
from fractions import Fraction

_HASH = re.compile(r"^[ \t]*####(?!#)[ \t]*(.*?)[ \t]*$", re.MULTILINE)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")
_FRAC = re.compile(r"^([+-]?)\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}$")
_FRAC_SHORT = re.compile(r"^([+-]?)\\[dt]?frac(\d)(\d)$")  # \frac34
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_EMPHASIS = re.compile(r"(\*{1,2})([^*].*?)\1\.?", re.DOTALL)  # '**52**', '*52*.'


def extract_hash_answer(text: str) -> str | None:
  """The text after the last '#### ' line (GSM8K style), or None."""
  return _last_hash(text)[1]


def _last_hash(text: str) -> tuple[int, str | None]:
  """(where the last '#### x' line starts, x), or (-1, None)."""
  found = list(_HASH.finditer(text))
  if not found or not found[-1].group(1):
    return -1, None
  return found[-1].start(), found[-1].group(1)


def extract_boxed(text: str) -> str | None:
  """The content of the last \\boxed{...} (or \\fbox{...}), nested braces allowed, or None.

  Also accepts the brace-less form '\\boxed 5'. An unclosed box gives None.
  """
  return _last_boxed(text)[1]


def _last_boxed(text: str) -> tuple[int, str | None]:
  """(where the last complete box starts, its content), or (-1, None)."""
  starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\s*", text)]
  for m in reversed(starts):
    i = m.end()
    if i < len(text) and text[i] == "{":
      depth = 0
      for j in range(i, len(text)):
        if text[j] == "{":
          depth += 1
        elif text[j] == "}":
          depth -= 1
          if depth == 0:
            return m.start(), text[i + 1:j].strip()
      continue  # unclosed: try an earlier box
    word = re.match(r"[^\s$]+", text[i:])
    if m.group(0) != m.group(0).rstrip() and word:  # '\boxed 5' needs the space
      return m.start(), word.group(0)
  return -1, None


def extract_last_number(text: str) -> str | None:
  """The last number in the text ('-1,234.5', '3/4', '.5'), or None."""
  found = _NUMBER.findall(text)
  return found[-1] if found else None


def extract_answer(text: str, fallback: bool = False) -> str | None:
  """The last '#### x' line or \\boxed{x}, whichever comes later, else None; fallback=True
  (for responses that were never asked for a format, e.g. a base model's) takes the last
  number instead of None."""
  _, found = max(_last_hash(text), _last_boxed(text), key=lambda hit: hit[0])
  if found is not None:
    return found
  return extract_last_number(text) if fallback else None


def normalize_answer(answer: str) -> str:
  """Strips what never changes an answer's meaning: whitespace (but for a space between two
  numbers: '2 3' and '3, 400' are two numbers, not 23 and 3,400), $, \\left/\\right, \\!,
  \\text{} wrappers, a trailing period, surrounding braces, and markdown emphasis around the
  whole answer ('**52**', as instruct models write it; '52*' keeps its star)."""
  s = answer.strip()
  if emphasis := _EMPHASIS.fullmatch(s):
    s = emphasis.group(2).strip()
  s = _TEXT.sub(r"\1", s)
  for junk in ("\\$", "$", "\\left", "\\right", "\\!", "\\,", "\\;", "\\ "):
    s = s.replace(junk, "")
  s = re.sub(r"(?<![\d,])\s+|\s+(?!\d)", "", s)
  s = s.rstrip(".")
  while len(s) >= 2 and s[0] == "{" and s[-1] == "}":
    s = s[1:-1]
  return s


def parse_number(answer: str) -> Fraction | None:
  """The exact value of a numeric answer, or None when it is not a plain number.

  '1,234' -> 1234, '-0.75' and '-3/4' and '-\\frac{3}{4}' and '\\dfrac34' -> -3/4,
  '5.0' -> 5, '+2' -> 2. A zero denominator gives None.
  """
  s = normalize_answer(answer)
  if _THOUSANDS.match(s):
    s = s.replace(",", "")
  m = _FRAC.match(s) or _FRAC_SHORT.match(s)
  if m:
    sign, num, den = m.groups()
    num_v, den_v = parse_number(num), parse_number(den)
    if num_v is None or den_v is None or den_v == 0:
      return None
    value = num_v / den_v
    return -value if sign == "-" else value
  if not re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)(/[+-]?\d+)?", s):
    return None
  try:
    return Fraction(s)
  except (ValueError, ZeroDivisionError):
    return None


def answers_match(predicted: str | None, reference: str | None) -> bool:
  """True when two final answers mean the same thing (see the module docstring); None never
  matches."""
  if predicted is None or reference is None:
    return False
  p, r = parse_number(predicted), parse_number(reference)
  if p is not None and r is not None:
    return p == r
  if (p is None) != (r is None):
    return False
  p_s, r_s = normalize_answer(predicted), normalize_answer(reference)
  return bool(p_s) and p_s == r_s
