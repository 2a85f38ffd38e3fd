"""What every job (train, sft, warmup_drafter, generate) does around its own work, in one
place: the command line, the workdir lock, which process writes, a clean stop on SIGINT/SIGTERM
(a second one stops at once), what the job is doing said from its first second, progress and
messages on the writing process only, the run log, checkpoints, exports and JSON files written
whole, the job's compile account, and an optional time limit.

  def body(config, job):                      # a job's own work; True: a signal stopped it
    job.phase("loading the policy")           # said at once; a stop asked for ends it here
    log = job.run_log(resume_step, config)    # metrics.jsonl & co. (+ TensorBoard, W&B)
    bar = job.progress(total=end, initial=step, desc="sft")
    while step < end and not job.stop.requested:
      ...                                       # one step
      end = job.last_step(step, end, "sft.max_minutes")  # max_minutes: this step is the last
    job.export(save_hf_checkpoint, job.path("export"), params, ...)  # process 0 writes
    job.write_json("summary.json", {...,  **job.compiles()})

  run_job(_CONFIG, _WORKDIR, body, "sft")     # the job's command line (its --config, --workdir)

Exit status: 0 when the job finished; EXIT_STOPPED (75) when a signal or its time limit ended
it before its last step (after a checkpoint; a time-limited job has also evaluated and
exported; a signal during the setup, at the next `phase`), so a scheduler knows to rerun the
same command, which resumes.

Multi-host: every process runs the same job on the global mesh and takes part in every
collective (gathers for exports included); only process 0 (`job.writer`) writes files and
holds the lock.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Callable, NoReturn

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from tqdm import tqdm

from tlt_jax import cli
from tlt_jax.checkpoint import Checkpointer, write_failure
from tlt_jax.compile_cache import COMPILES, guard_cpu_collectives
from tlt_jax.components import first_line
from tlt_jax.config import ConfigError, RunStopped, flat_settings
from tlt_jax.mesh import host_copy
from tlt_jax.metric_writers import writers_from_config
from tlt_jax.profiling import write_profile_summary
from tlt_jax.run_log import RunLog, replace_folder, steps_done, write_json
from tlt_jax.workdir import claim_workdir

# The exit status of a run that a signal or its time limit stopped after its checkpoint
# (sysexits' EX_TEMPFAIL: "try again later"), so a scheduler can tell a run that must be
# resumed from a finished one.
EXIT_STOPPED = 75


def exit_stopped(where: str, what: str = "stopped") -> NoReturn:
  """Ends a job that a signal or its time limit stopped after its checkpoint: says so on
  stderr and exits with EXIT_STOPPED. where: how far it got, e.g. 'after step 12 of 100';
  what: what ended it."""
  print(f"{what} {where} with a checkpoint; rerun the same command to resume (exit status "
        f"{EXIT_STOPPED})", file=sys.stderr)
  sys.exit(EXIT_STOPPED)


class SetupStopped(Exception):
  """A signal asked the job to stop before its loop began (see `Job.phase`)."""


class StopFlag:
  """SIGINT/SIGTERM ask for a clean stop after the current step, or at the next phase of the
  job's setup (`Job.phase`); a second one stops the process at once."""

  def __init__(self):
    self.requested = False
    self._old = {}

  def __enter__(self):
    for sig in (signal.SIGINT, signal.SIGTERM):
      try:
        self._old[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (e.g. run from a notebook's worker)
        pass
    return self

  def _handle(self, signum, frame):
    self.requested = True
    # The second signal ends the process in the kernel, not in a Python handler: a handler
    # runs only between bytecodes, and a compile or a generation holds the main thread in
    # C++ for minutes.
    for sig in self._old:
      signal.signal(sig, signal.SIG_DFL)
    tqdm.write(f"received {signal.Signals(signum).name}: stopping after this step (or what "
               f"the job is doing now: a compile or a generation finishes first); a second "
               f"signal stops it at once")

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)
    self._old = {}


class Job:
  """A job's skeleton over `workdir`; see the module docstring. show_progress=False hides the
  progress bars (tests, notebooks). max_minutes > 0: `time_up()` turns true once the job has
  run that long, and the job then ends its training as if that step were its last (evaluation,
  export, summary), so a run on a lease of fixed length still ends with results; it then
  exits with EXIT_STOPPED (`time_limited` says why), as its rerun resumes."""

  def __init__(self, workdir: str, show_progress: bool = True, max_minutes: float = 0.0,
               profile: tuple[int, int] = (0, 0), name: str | None = None,
               settings: dict | None = None, heartbeat_s: float = 30.0):
    self.workdir, self.show_progress, self.max_minutes = workdir, show_progress, max_minutes
    # While a phase (`phase`) runs silent this long, a line says it still does; then after
    # twice as long, and so on: compiling and hanging look alike otherwise.
    self.heartbeat_s = heartbeat_s
    self._phase: str | None = None
    self._said_at = 0.0
    self._next_beat = heartbeat_s
    self._beats: threading.Event | None = None  # set: the heartbeat thread ends
    # name: the job (train, sft, warmup_drafter, generate); the workdir is refused when
    # another kind of job made it (tlt_jax.workdir.check_workdir_job). settings: its flat
    # settings, whose fingerprint the workdir records.
    self.name, self.settings = name, settings
    self.profile = tuple(profile)  # (first step, steps) that `traced` traces; (x, 0): none
    self.writer = jax.process_index() == 0
    self.stop = StopFlag()
    self._lock = None
    self._trace_steps: list[int] | None = None  # while a trace runs: the steps it holds
    # Once the time limit cut the job short: what ended it, where (see `last_step`).
    self.time_limited: tuple[str, str] | None = None

  def __enter__(self) -> Job:
    self._lock = claim_workdir(self.workdir, self.name, self.settings)
    self.stop.__enter__()
    self.started = time.perf_counter()
    guard_cpu_collectives()  # also where JAX's own settings turned the cache on
    COMPILES.start()
    self._compiles_before = COMPILES.report()
    self._said_at = self.started
    if self.writer and self.heartbeat_s > 0:
      self._beats = threading.Event()
      threading.Thread(target=self._heartbeat, args=(self._beats,), daemon=True,
                       name="tlt_jax job heartbeat").start()
    return self

  def __exit__(self, *exc):
    if self._beats is not None:
      self._beats.set()
      self._beats = None
    if self._trace_steps is not None:  # the loop ended inside the profile window
      self._end_trace(summarize=exc[0] is None)
    self.stop.__exit__(*exc)
    if self._lock is not None:
      self._lock.release()
      self._lock = None
    if exc[0] is SetupStopped:  # the lock is free: the rerun may start at once
      print(f"stopped by a signal {exc[1]}; rerun the same command to go on (exit status "
            f"{EXIT_STOPPED})", file=sys.stderr)
      sys.exit(EXIT_STOPPED)

  def say(self, text: str) -> None:
    """A message on the writing process (above any progress bar)."""
    if self.writer:
      tqdm.write(text)
      self._said_at = time.perf_counter()

  def phase(self, what: str) -> None:
    """Says what the job does next ('[  12 s] compiling ...'), before anything long: a stop
    that a signal asked for is honoured here (the job ends, exiting with EXIT_STOPPED), and
    while the phase runs silent, a line now and then says it still does, with the programs
    compiled so far."""
    if self.stop.requested:
      raise SetupStopped(f"before {what}")
    self._phase, self._next_beat = what, self.heartbeat_s
    self.say(f"[{self.wall_s:6.0f} s] {what}")

  def _heartbeat(self, done: threading.Event) -> None:
    while not done.wait(1.0):
      silent = time.perf_counter() - self._said_at
      if self._phase is not None and silent >= self._next_beat:
        self._next_beat *= 2
        compiled = COMPILES.report()["xla_compiles"] - self._compiles_before["xla_compiles"]
        self.say(f"[{self.wall_s:6.0f} s] still {self._phase} ({compiled} programs compiled "
                 f"so far)")

  def progress(self, **tqdm_kwargs) -> tqdm:
    """A progress bar, shown on the writing process only; it shows the job's progress from
    here on, in place of the heartbeat of the phase before it."""
    self._phase = None
    return tqdm(disable=not (self.show_progress and self.writer), **tqdm_kwargs)

  def path(self, *parts: str) -> str:
    return os.path.join(self.workdir, *parts)

  def run_log(self, resume_step: int = 0, config=None) -> RunLog:
    """The job's JSONL files (see RunLog), rows past resume_step dropped; process 0 writes,
    and mirrors them to the metric writers that config.logging asks for (TensorBoard, W&B:
    `tlt_jax.metric_writers`)."""
    if resume_step == 0 and self.writer:
      self._refuse_to_overwrite_an_earlier_run()
    try:
      mirrors = (writers_from_config(config.logging, self.workdir, resume_step,
                                     flat_settings(config))
                 if config is not None and self.writer else ())
    except ValueError as e:  # a writer's folder that cannot be written
      raise ConfigError(str(e)) from None
    return RunLog(self.workdir, resume_step=resume_step, write=self.writer, mirrors=mirrors)

  def _refuse_to_overwrite_an_earlier_run(self) -> None:
    """A job starting from step 0 in a folder whose metrics.jsonl holds steps of an earlier
    run (none of its checkpoints loaded: they were written by an earlier version's layout or
    are damaged, and were set aside or left as they are) would overwrite that run's metrics,
    evaluations and export: ConfigError instead, before anything is written."""
    done = steps_done(self.workdir)
    if done:
      raise ConfigError(
          f"--workdir {self.workdir!r} holds an earlier run of python -m tlt_jax.{self.name} "
          f"(metrics of steps {done[0]}-{done[-1]}) but none of its checkpoints loaded (see "
          f"the warnings above); starting from step 0 would overwrite its files: give "
          f"another --workdir, or move its files away first")

  def write_json(self, name: str, obj: dict, folder: str | None = None) -> None:
    """WORKDIR/name (or folder/name) as indented JSON, written whole (never half a file),
    by the writing process."""
    if self.writer:
      write_json(os.path.join(folder or self.workdir, name), obj)

  def export(self, save, folder: str, tree, *args, **kwargs) -> None:
    """`save(folder, host copy of tree, *args, **kwargs)` on the writing process; every
    process takes part in the gather. The folder is written beside `folder` and renamed into
    place (replacing an earlier export), so no half-written export is ever left; a write that
    fails (a full disk) stops the job in one line (RunStopped) naming the folder and the
    space it needs."""
    tree = host_copy(tree)
    if not self.writer:
      return
    folder = os.path.abspath(folder)
    parent, staging = os.path.dirname(folder), None
    try:
      os.makedirs(parent, exist_ok=True)
      staging = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", dir=parent)
      os.chmod(staging, 0o755)  # mkdtemp's folder is private; an export need not be
      save(staging, tree, *args, **kwargs)
      replace_folder(staging, folder)  # an earlier export (this job's own) is replaced whole
    except Exception as e:  # noqa: BLE001 -- an OSError, or safetensors' error naming one
      why = write_failure(e)
      if why is None:
        raise
      needed = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree)) / 2 ** 20
      raise RunStopped(f"the export to {folder} could not be written: {why} "
                       f"({getattr(e, 'filename', None) or parent}); it needs about "
                       f"{needed:.0f} MB; no half-written export is left, the checkpoints are "
                       f"intact: free the space and rerun the same command (it exports "
                       f"again)") from None
    finally:
      if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)

  def checkpointer(self, config, keep: int = 2) -> Checkpointer:
    """WORKDIR/checkpoints, keeping the latest `keep`, each with the config's settings."""
    return Checkpointer(self.path("checkpoints"), keep=keep, settings=flat_settings(config))

  @property
  def wall_s(self) -> float:
    """Seconds since the job began."""
    return time.perf_counter() - self.started

  def time_up(self) -> bool:
    """Whether the job has run max_minutes (never without a limit). Every process takes
    process 0's answer, so all of them leave the loop after the same step."""
    if not self.max_minutes:
      return False
    up = self.wall_s >= 60.0 * self.max_minutes
    if jax.process_count() > 1:
      up = bool(multihost_utils.broadcast_one_to_all(np.asarray(up)))
    return up

  def last_step(self, step: int, end: int, setting: str) -> int:
    """The last step once `step` is done: `end`, or `step` when it comes before `end` and
    time_up() (which it says; `setting`: the config key that set max_minutes)."""
    if step < end and self.time_up():
      self.say(f"{setting}={self.max_minutes} reached: step {step} is the last")
      self.time_limited = (f"{setting}={self.max_minutes} ended the job",
                           f"after step {step} of {end}")
      return step
    return end

  @contextlib.contextmanager
  def traced(self, step: int, outputs: Callable[[], object] = lambda: None):
    """Runs step `step` (1-based, as in metrics.jsonl) of the job's loop under jax.profiler
    when `profile` = (first, count) holds it (process 0 traces; every process runs the same
    programs). After the window's last step it waits for `outputs()` (the step's results, so
    that their device work is in the trace) and writes WORKDIR/profile/summary.json and
    top_ops.png (`tlt_jax.profiling`); a loop that ends inside the window ends the trace too."""
    first, count = self.profile
    inside = self.writer and count > 0 and first <= step < first + count
    if inside and self._trace_steps is None:
      try:  # a profile is a by-product: the job goes on without one
        jax.profiler.start_trace(self.path("profile"))
        self._trace_steps = []
      except Exception as e:  # noqa: BLE001 -- e.g. a GPU without its profiling library
        self.say(f"profile: jax.profiler could not start ({first_line(e)}); no trace")
        self.profile, inside = (first, 0), False
    yield
    if inside:
      self._trace_steps.append(step)
      if step == first + count - 1:
        jax.block_until_ready(outputs())
        self._end_trace()

  def _end_trace(self, summarize: bool = True) -> None:
    steps, self._trace_steps = self._trace_steps, None
    try:
      jax.profiler.stop_trace()
      s = write_profile_summary(self.path("profile"), steps) if summarize and steps else None
    except Exception as e:  # noqa: BLE001 -- the job's own results matter more
      self.say(f"profile: the trace of steps {steps} could not be summarized ({first_line(e)})")
      return
    if s is not None:
      kinds = ", ".join(f"{k['kind']} {k['share']:.0%}" for k in s["kinds"][:3])
      self.say(f"profile of steps {steps}: {s['op_s']:.3f} s of {s['source']} op time "
               f"({kinds or 'no XLA ops traced'}); {self.path('profile', 'summary.json')}, "
               f"top_ops.png")

  def compiles(self) -> dict:
    """The job's XLA compiles so far (`COMPILES.report()` since the job began)."""
    return {k: v - self._compiles_before[k] for k, v in COMPILES.report().items()}


def run_job(config_flag, workdir_flag, body, name: str, max_minutes=lambda config: 0.0,
            quiet_logs: bool = True, writes_metrics: bool = True) -> None:
  """A job's command line (`python -m`, console script): loads --config (errors exit in one
  line), sets the devices up and runs `body(config, job)` in a Job `name` over --workdir with
  max_minutes(config); exits with EXIT_STOPPED when body returns True (a signal stopped it,
  after its checkpoint) or its time limit ended it (`Job.time_limited`), else 0. quiet_logs:
  absl logs from WARNING up (orbax logs every save at INFO). writes_metrics=False: the job
  writes no run log, so the config's logging.* knobs are refused (`validate_config`)."""

  def main(argv):
    del argv
    if quiet_logs:
      logging.set_verbosity(logging.WARNING)
    config = cli.load_config(config_flag)
    cli.setup_devices(config, writes_metrics=writes_metrics)
    with Job(workdir_flag.value, max_minutes=max_minutes(config),
             profile=profile_window(config), name=name,
             settings=flat_settings(config)) as job:
      stopped = body(config, job)
    if stopped:
      exit_stopped("before the last step")
    if job.time_limited:
      what, where = job.time_limited
      exit_stopped(where, what)
  cli.run_main(main)


def profile_window(config) -> tuple[int, int]:
  """(profile.first_step, profile.num_steps): the steps a job's `Job.traced` traces."""
  return config.profile.first_step, config.profile.num_steps


def check_profile_window(config, last_step: int, steps_key: str) -> None:
  """ConfigError (one line) when profile.* asks for a trace that starts past the job's last
  step (`steps_key`=`last_step`): it would trace nothing."""
  first, count = profile_window(config)
  if count and first > last_step:
    raise ConfigError(f"profile.first_step={first} is past the job's last step ({steps_key}="
                      f"{last_step}): nothing would be traced; set profile.first_step between "
                      f"1 and {last_step}, or profile.num_steps=0")
