"""Answer extraction and equivalence on tricky strings."""

import pytest

from tlt_jax.rl.answers import (answers_match, extract_answer, extract_boxed, extract_hash_answer,
                                extract_last_number, parse_number)


@pytest.mark.parametrize("text,expected", [
    ("7+5=12\n12*3=36\n#### 36", "36"),
    ("work\n#### 1,234", "1,234"),
    ("#### -7\nmore text\n#### 8", "8"),  # the last one wins
    (r"so the answer is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{x^{2}+\sqrt{\frac{a}{b}}} is it", r"x^{2}+\sqrt{\frac{a}{b}}"),  # nested braces
    (r"first \boxed{1} then \boxed{2}", "2"),
    (r"\fbox{42}", "42"),
    (r"the answer: \boxed 5", "5"),
    ("no answer here", None),
    ("", None),
    (r"\boxed{unclosed", None),
    ("7+5=12\n12*3=36", None),  # no '####' line: the last number is not taken ...
    # Markdown headings are not answer lines: the answer stated last wins.
    ("#### Step 1: add\n2+3=5\n#### Step 2: double\n5*2=10\nSo \\boxed{10}.", "10"),
    ("##### Final\n\\boxed{10}", "10"),
    ("##### 9", None),
    ("\\boxed{3} is wrong, so\n#### 4", "4"),
    ("####\n42", None),  # an empty answer line does not reach into the next line
])
def test_extract_answer(text, expected):
  assert extract_answer(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("the values are -3 and 12.5", "12.5"),  # ... unless asked for
    ("she paid $1,250.50 in total", "1,250.50"),
    ("a ratio of 3/4", "3/4"),
    ("7+5=12\n12*3=36", "36"),
    ("work\n#### 8\nthen 9", "8"),  # the format still wins
    ("no answer here", None),
])
def test_extract_answer_with_the_last_number_fallback(text, expected):
  assert extract_answer(text, fallback=True) == expected


def test_extractors_alone():
  assert extract_hash_answer("12\n####   -5  ") == "-5"
  assert extract_hash_answer("#### ") is None
  assert extract_boxed("no box") is None
  assert extract_last_number("x = -.5") == "-.5"
  assert extract_answer("the answer is 3") is None


@pytest.mark.parametrize("a,b", [
    ("1,234", "1234"), ("-3", "-3"), ("0.75", "3/4"), (r"\frac{3}{4}", "0.75"),
    (r"\dfrac{3}{4}", "3/4"), (r"-\frac{1}{2}", "-0.5"), (r"\tfrac12", "0.5"), ("5.0", "5"),
    ("5.", "5"), (" 7 ", "7"), ("$12$", "12"), (r"\$12", "12"), ("+2", "2"),
    (r"\text{(A)}", "(A)"), ("x + 1", "x+1"), ("{12}", "12"), (r"\left(1,2\right)", "(1,2)"),
    ("1,000,000", "1000000"), ("- 5", "-5"), ("x = 5", "x=5"), ("5 .", "5"), ("3 / 4", "0.75"),
    ("**52**", "52"), ("*3/4*", "0.75"), ("**52**.", "52"), ("** 52 **", "52"),
])
def test_equivalent(a, b):
  assert answers_match(a, b) and answers_match(b, a)


@pytest.mark.parametrize("a,b", [
    ("3", "-3"), ("0.75", "0.7"), ("1,2", "12"), ("12", "(A)"), (None, "3"), ("3", None),
    ("", ""), (r"\frac{1}{0}", "1"), ("x+1", "x+2"),
    # Two numbers are not one: the space between them stays.
    ("2 3", "23"), ("12 15", "1215"), ("3, 400", "3400"),
    # Emphasis counts only around the whole answer: a product or a stray star is not it.
    ("52*", "52"), ("*52", "52"), ("2*3", "6"), ("**52*", "52"),
])
def test_not_equivalent(a, b):
  assert not answers_match(a, b)


def test_parse_number():
  assert parse_number("1,234.5") * 2 == 2469
  assert parse_number(r"-\dfrac{6}{8}") == parse_number("-0.75")
  assert parse_number("abc") is None and parse_number("1/0") is None
  assert parse_number("2 3") is None and parse_number(extract_answer(r"\boxed{3, 400}")) is None
