"""notebooks/drafter_ablation.ipynb runs headless in its quick setting and writes its outputs."""

import json
import os

import nbclient
import nbformat
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "drafter_ablation.ipynb")
VARIANTS = {"untrained", "eagle-1L", "eagle-2L", "tokens-only", "fused", "mlp-64", "mlp-1024",
            "suffix", "eagle-1L+suffix"}


@pytest.mark.slow
def test_drafter_ablation_notebook_quick(tmp_path, monkeypatch):
  # The kernel is a child process: it inherits these.
  monkeypatch.setenv("TLT_NOTEBOOK_QUICK", "1")
  monkeypatch.setenv("TLT_NOTEBOOK_OUT", str(tmp_path))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": REPO}})
  client.execute()  # raises CellExecutionError (with the cell's traceback) if a cell fails

  data = json.loads((tmp_path / "drafter_ablation.json").read_text())
  assert (tmp_path / "drafter_ablation.png").stat().st_size > 0
  assert data["settings"]["quick"] is True
  rows = data["rows"]
  assert {r["variant"] for r in rows} == VARIANTS and len(rows) == len(VARIANTS)
  max_accept = data["settings"]["strategy"][0] + 1  # accepted path + bonus <= steps + 1
  for r in rows:
    assert 1.0 <= r["accept_len"] <= max_accept, r
    assert (r["params"] > 0) == (r["variant"] != "suffix") and r["sd_tokens_per_s"] > 0
    if r["steps"]:
      assert r["loss_last"] < r["loss_first"], r
      assert r["train_s"] > 0 and len(data["loss_curves"][r["variant"]]) == r["steps"]
  params = {r["variant"]: r["params"] for r in rows}
  # The architecture knobs reached the drafters: deeper, wider and fused ones are bigger,
  # tokens-only and narrower ones smaller.
  assert params["eagle-2L"] > params["eagle-1L"] > params["tokens-only"]
  assert params["mlp-1024"] > params["eagle-1L"] > params["mlp-64"]
  assert params["fused"] > params["eagle-1L"]
