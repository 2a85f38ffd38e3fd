"""notebooks/drafter_ablation.ipynb runs headless in its quick setting and writes its outputs."""

import json
import os

import nbclient
import nbformat
import pytest

from tlt_jax.drafters import DRAFTERS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "drafter_ablation.ipynb")
VARIANTS = {"plain", "eagle-1L", "eagle-2L", "eagle3-ttt", "mtp", "suffix", "prompt_lookup",
            "eagle-1L+suffix", "mtp+prompt_lookup", "eagle-1L+mtp"}


@pytest.mark.slow
def test_drafter_ablation_notebook_quick(tmp_path, monkeypatch):
  # The kernel is a child process: it inherits these.
  monkeypatch.setenv("TLT_NOTEBOOK_QUICK", "1")
  monkeypatch.setenv("TLT_NOTEBOOK_OUT", str(tmp_path))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": REPO}})
  client.execute()  # raises CellExecutionError (with the cell's traceback) if a cell fails

  data = json.loads((tmp_path / "drafter_ablation.json").read_text())
  assert (tmp_path / "drafter_ablation.png").stat().st_size > 0
  assert (tmp_path / "drafter_ablation.md").read_text().startswith("| model | variant |")
  assert data["settings"]["quick"] is True and data["settings"]["models"] == ["tiny"]
  rows = data["rows"]
  assert {r["variant"] for r in rows} == VARIANTS
  # Every registered family is measured, alone and in a hybrid.
  assert {f for r in rows for f in r["families"]} == set(DRAFTERS)
  by = {r["variant"]: r for r in rows}
  for r in rows:
    assert r["identical"], r  # SD emits plain decoding's tokens
    if r["variant"] == "plain":
      continue
    depth = int(r["strategy"].split(",")[0])
    assert r["strategy"].endswith("+".join(r["families"]))
    assert 1.0 <= r["accept_len"] <= depth + 1, r
    assert r["iteration_ms"] > 0 and r["tail_speedup"] > 0 and r["decode_s"] > 0
    trained = [f for f in r["families"] if DRAFTERS[f].trained]
    assert (r["params"] > 0) == bool(trained) and (r["train_s"] > 0) == bool(trained)
  # The architecture knobs reached the drafters; a hybrid counts its families' weights.
  assert by["eagle-2L"]["params"] > by["eagle3-ttt"]["params"] > by["eagle-1L"]["params"]
  assert by["eagle-1L+mtp"]["params"] == by["eagle-1L"]["params"] + by["mtp"]["params"]
  for name in ("eagle-1L", "eagle3-ttt", "mtp"):
    assert by[name]["loss_last"] < by[name]["loss_first"], by[name]
