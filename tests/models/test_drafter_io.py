"""Drafter folders: a reduced-vocabulary drafter round-trips with EAGLE-3's vocabulary tensors,
and a folder whose maps disagree is refused."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.speculative.drafters import random_drafter
from tlt_jax.drafters.eagle.draft_vocab import frequent_tokens, ids_from_offsets, offsets_from_ids
from tlt_jax.drafters.eagle.network import DRAFT_TO_POLICY, with_draft_vocab
from tlt_jax.drafters.io import load_drafter, save_drafter


def test_frequent_tokens_and_offsets():
  d2t = frequent_tokens([[7, 7, 7, 3, 3, 9], [9, 9, 1, 5]], vocab_size=12, size=4)
  np.testing.assert_array_equal(d2t, [1, 3, 7, 9])  # 7, 9 x3, 3 x2, then 1 before 5 (x1)
  assert d2t.dtype == np.int32
  np.testing.assert_array_equal(offsets_from_ids(d2t), [1, 2, 5, 6])
  np.testing.assert_array_equal(frequent_tokens([[5]], 12, 3), [0, 1, 5])  # unseen: lowest
  np.testing.assert_array_equal(ids_from_offsets(offsets_from_ids(d2t)), d2t)
  with pytest.raises(ValueError, match="draft vocabulary size 13 must be in 1..12"):
    frequent_tokens([[1]], vocab_size=12, size=13)
  with pytest.raises(ValueError, match="token ids must lie in 0..11"):
    frequent_tokens([[1, 12]], vocab_size=12, size=2)


def test_reduced_vocab_drafter_round_trips_in_eagle3_layout(tmp_path, tiny_cfg, tiny_params):
  dcfg, params = random_drafter(tiny_cfg, seed=5, draft_vocab_size=16)
  d2t = frequent_tokens([np.arange(0, tiny_cfg.vocab_size, 3)], tiny_cfg.vocab_size, 16)
  params = with_draft_vocab(params, tiny_params, d2t, tiny_cfg)
  save_drafter(str(tmp_path), "eagle", dcfg, params, tiny_cfg)

  tensors = load_file(tmp_path / "model.safetensors")
  assert tensors["lm_head.weight"].shape == (16, tiny_cfg.hidden_size)
  assert tensors["d2t"].dtype == np.int64
  np.testing.assert_array_equal(tensors["d2t"] + np.arange(16), d2t)  # EAGLE-3's offsets
  assert tensors["t2d"].dtype == bool and tensors["t2d"].sum() == 16
  np.testing.assert_array_equal(np.flatnonzero(tensors["t2d"]), d2t)
  assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 16

  _, loaded_cfg, loaded = load_drafter(str(tmp_path), tiny_cfg)
  assert loaded_cfg == dcfg
  np.testing.assert_array_equal(loaded[DRAFT_TO_POLICY], d2t)
  assert loaded[DRAFT_TO_POLICY].dtype == np.int32
  np.testing.assert_array_equal(loaded["lm_head"]["kernel"],
                                np.asarray(params["lm_head"]["kernel"]))
  np.testing.assert_array_equal(loaded["fc"]["kernel"], np.asarray(params["fc"]["kernel"]))

  # t2d that disagrees with d2t: refused, naming both.
  tensors["t2d"][int(np.flatnonzero(~tensors["t2d"])[0])] = True
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match="its d2t and t2d do not describe one draft vocabulary"):
    load_drafter(str(tmp_path), tiny_cfg)


def test_feature_layers_round_trip_and_older_exports(tmp_path, tiny_cfg):
  dcfg, params = random_drafter(tiny_cfg, seed=2, feature_layers=[1, 0])
  save_drafter(str(tmp_path), "eagle", dcfg, params, tiny_cfg)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["drafter"]["feature_layers"] == [1, 0]
  _, loaded_cfg, loaded = load_drafter(str(tmp_path), tiny_cfg)
  assert loaded_cfg == dcfg and loaded_cfg.feature_layers == (1, 0)
  assert loaded["fuse"]["kernel"].shape == (3 * tiny_cfg.hidden_size, tiny_cfg.hidden_size)

  # An export from before feature_layers counted them: 0 reads as (), a count is refused.
  plain_cfg, plain = random_drafter(tiny_cfg, seed=2)
  old = tmp_path / "old"
  save_drafter(str(old), "eagle", plain_cfg, plain, tiny_cfg)
  config = json.loads((old / "config.json").read_text())
  del config["drafter"]["feature_layers"]
  config["drafter"]["fused_features"] = 0
  (old / "config.json").write_text(json.dumps(config))
  assert load_drafter(str(old), tiny_cfg)[1] == plain_cfg
  config["drafter"]["fused_features"] = 2
  (old / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"fused_features=2 without naming .* \"feature_layers\""):
    load_drafter(str(old), tiny_cfg)
