"""The GPU lease's transport: what a device run needs beyond the working tree (a model file,
wheels the device's image lacks), staged through the device's /tmp over as many calls as it
takes, and a rehearsal of those calls under the device's rules on this machine.

The device's rules (as a lease on an H200 showed them, 2026-12-04): a call carries the working
tree and the ignored paths it names, CALL_LIMIT in all; a carried path that the next call does
not name again is removed there; what a command writes under /tmp survives while the machine is
warm (the next call within 30 s); at most MAX_FILES files of FILE_LIMIT come back from $OUT,
none deeper than $OUT/a/b/file. So `stage` cuts the payload into one folder per call
(<stage>/call<k>, each with the manifest of every part: its call and sha256); call k copies its
folder into $TLT_LEASE_TMP/tlt_lease (default /tmp) and verifies the parts of calls 1..k there;
the last call also runs the job, which reads its inputs from there (`join`). Call 1 installs
the wheels into $TLT_LEASE_TMP/site, where the later calls find them.

  python -m experiments.gpu_lease check --parts /tmp/tlt_lease --call 2     (on the device)
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import lzma
import os
import pathlib
import shutil
import subprocess
import sys
import time

# This module runs first on the device, before the wheels it brings are installed: it imports
# nothing beyond the standard library (not even the project's JSON helpers).

REPO = pathlib.Path(__file__).resolve().parents[1]
MiB = 1 << 20
CALL_LIMIT = 64 * MiB
MAX_FILES = 8
FILE_LIMIT = 16 * MiB
MARGIN = MiB // 2     # what the tree may gain between staging and the calls
MANIFEST_ROOM = 64 * 1024
STAGE_DIR = "tlt_lease"  # under $TLT_LEASE_TMP (default /tmp) on the device
# On the device: where staged parts and installed wheels live between calls.
DEVICE_TMP = "${TLT_LEASE_TMP:-/tmp}"


class LeaseError(Exception):
  """What went wrong, in one line, with what to do about it."""


class RuleBroken(LeaseError):
  """A plan did something the device does not allow."""


def sha256(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      h.update(block)
  return h.hexdigest()


def tree_files() -> list[str]:
  """What a device call sends besides its carried paths: the files git tracks and the
  untracked ones it does not ignore (paths relative to the repository)."""
  out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       cwd=REPO, capture_output=True, check=True).stdout
  return [name for name in out.decode().split("\0") if name and (REPO / name).is_file()]


def compress(path: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
  """`path` xz-compressed into `dest` (written beside it and renamed in)."""
  print(f"compressing {path.name} ({path.stat().st_size / MiB:.1f} MiB) with xz ...", flush=True)
  tmp = dest.with_name(f".{dest.name}.tmp")
  with open(path, "rb") as src, lzma.open(tmp, "wb", preset=6) as dst:
    shutil.copyfileobj(src, dst, 1 << 22)
  os.replace(tmp, dest)
  return dest


def download_wheels(dest: pathlib.Path, requirements) -> list[pathlib.Path]:
  """The wheels of `requirements` for the device image's Python (3.12, x86-64), without
  their dependencies (the image has them)."""
  dest.mkdir(parents=True, exist_ok=True)
  proc = subprocess.run(
      [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
       "--python-version", "3.12", "--implementation", "cp", "--platform",
       "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
       "--disable-pip-version-check", "--retries", "2", "--timeout", "30", "-d", str(dest),
       *requirements], capture_output=True, text=True)
  if proc.returncode:
    errors = [line for line in (proc.stderr + proc.stdout).splitlines()
              if line.startswith("ERROR")] or [f"exit status {proc.returncode}"]
    raise LeaseError(f"pip could not download the wheels {', '.join(requirements)} (no "
                     f"network or no package index?): {errors[-1]}")
  return sorted(dest.glob("*.whl"))


# ---------------------------------------------------------------- stage (here)


def stage(out: pathlib.Path, name: str, path: pathlib.Path, wheels=(), tree: int | None = None,
          min_calls: int = 1) -> dict:
  """Cuts the file at `path` (sent as it is, as `name`) into one part per call over as few
  calls as fit (at least min_calls), call 1 also carrying `wheels`: OUT/call<k>/ with its
  part and manifest.json. OUT may hold only what staging wrote (call folders, plan.json).
  Returns the manifest (`calls`: how many; `payload_bytes`: what each call carries with the
  working tree, of `tree` bytes, default this one's)."""
  foreign = sorted(p.name for p in out.iterdir() if p.name != "plan.json" and not (
      p.is_dir() and p.name.startswith("call"))) if out.is_dir() else []
  if out.exists() and (foreign or not out.is_dir()):
    raise LeaseError(f"{out} holds {foreign[:3]}, which staging did not write; give an empty "
                     f"or new folder" if foreign else f"{out} is a file; give a folder")
  tree = sum((REPO / f).stat().st_size for f in tree_files()) if tree is None else tree
  wheel_bytes = sum(pathlib.Path(w).stat().st_size for w in wheels)
  room = CALL_LIMIT - MARGIN - MANIFEST_ROOM - tree
  if room - wheel_bytes <= 0:
    raise LeaseError(f"the working tree ({tree / MiB:.1f} MiB) leaves no room in a call of "
                     f"{CALL_LIMIT / MiB:.0f} MiB; make it smaller (git ls-files -co "
                     f"--exclude-standard lists it)")
  size = path.stat().st_size
  calls = max(min_calls, 1 + max(0, -(-(size - (room - wheel_bytes)) // room)))
  # Even shares, call 1's smaller by the wheels: each call keeps the same room for what the
  # tree gains before the lease.
  share = -(-(size + wheel_bytes) // calls)
  parts = []
  with open(path, "rb") as src:
    for k in range(1, calls + 1):
      shutil.rmtree(out / f"call{k}", ignore_errors=True)
      (out / f"call{k}").mkdir(parents=True)
      part = out / f"call{k}" / f"{name}.part{k}"
      part.write_bytes(src.read(max(share - wheel_bytes * (k == 1), 0) if k < calls else -1))
      parts.append({"file": f"call{k}/{part.name}", "bytes": part.stat().st_size,
                    "sha256": sha256(part), "call": k})
  copied = []
  for w in wheels:
    dest = out / "call1" / "wheels" / pathlib.Path(w).name
    dest.parent.mkdir(exist_ok=True)
    shutil.copyfile(w, dest)
    copied.append({"file": f"call1/wheels/{dest.name}", "sha256": sha256(dest), "call": 1})
  manifest = {"name": name, "bytes": size, "sha256": sha256(path), "parts": parts,
              "wheels": copied, "calls": calls, "working_tree_bytes": tree,
              "staged": datetime.datetime.now().isoformat(timespec="seconds")}
  for k in range(1, calls + 1):
    tmp = out / f"call{k}" / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / f"call{k}" / "manifest.json")
  manifest["payload_bytes"] = [tree + sum(f.stat().st_size for f in (out / f"call{k}").rglob("*")
                                          if f.is_file()) for k in range(1, calls + 1)]
  return manifest


def commands(stage_rel: str, calls: int, final: str, wheels: bool = True) -> list[str]:
  """Each call's command: copy its folder into the device's staging folder, verify every
  part that has arrived there so far, and (the last call) run `final` with the parts'
  folder in $PARTS; call 1 installs the wheels."""
  site = f"{DEVICE_TMP}/site"
  out = []
  for k in range(1, calls + 1):
    cmd = (f"set -o pipefail; export PYTHONUNBUFFERED=1 PARTS={DEVICE_TMP}/{STAGE_DIR}; "
           f"mkdir -p $PARTS && cp -r {stage_rel}/call{k} $PARTS/ && ")
    if wheels and k == 1:
      cmd += (f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
              f"--target {site} $PARTS/call1/wheels/*.whl && ")
    cmd += f"python3 -m experiments.gpu_lease check --parts $PARTS --call {k}"
    if k == calls:
      cmd += f" && export PYTHONPATH={site}:. && {final}"
    out.append(cmd)
  return out


# ---------------------------------------------------------------- check and join (device)


def _repeat(call: int, upto: int) -> str:
  if call == upto:
    return f"repeat device call {call}"
  return (f"repeat device call {call}, then calls {call + 1}..{upto} (each within 30 s of "
          f"the last one's end; after 30 s the machine is gone: all calls again)")


def verify(parts: pathlib.Path, upto: int | None = None) -> dict:
  """The manifest, once every part of calls 1..upto (all: None) and call 1's wheels are in
  `parts` with their sha256; LeaseError naming the call to repeat otherwise."""
  manifests = sorted(parts.glob("call*/manifest.json"))
  if not manifests:
    raise LeaseError(f"{parts} holds no call folder with a manifest.json: stage here, then "
                     f"make device call 1 (it copies its folder there)")
  try:
    manifest = json.loads(manifests[0].read_text())
    upto = manifest["calls"] if upto is None else upto
    wanted = [p for p in manifest["parts"] + manifest["wheels"] if p["call"] <= upto]
  except (json.JSONDecodeError, KeyError, TypeError) as e:
    call = manifests[0].parent.name.removeprefix("call")
    raise LeaseError(f"{manifests[0]} is damaged ({type(e).__name__}: {e}): "
                     f"{_repeat(int(call) if call.isdigit() else 1, upto or 1)}") from None
  for item in wanted:
    path = parts / item["file"]
    if not path.is_file():
      raise LeaseError(f"{item['file']} has not arrived: {_repeat(item['call'], upto)}")
    if sha256(path) != item["sha256"]:
      raise LeaseError(f"{item['file']} arrived damaged (its sha256 differs from the "
                       f"manifest's): {_repeat(item['call'], upto)}")
  return manifest


def join(parts: pathlib.Path, manifest: dict, dest: pathlib.Path) -> pathlib.Path:
  """The staged file made again from its verified parts in dest (checked against its
  sha256; a '.xz' name is decompressed into the name without it)."""
  dest.mkdir(parents=True, exist_ok=True)
  name = manifest["name"]
  path = dest / name.removesuffix(".xz")
  tmp = path.with_name(f".{path.name}.tmp")
  sent = hashlib.sha256()  # of the file as staged (compressed or not)
  decompressor = lzma.LZMADecompressor() if name.endswith(".xz") else None
  with open(tmp, "wb") as out:
    for piece in sorted(manifest["parts"], key=lambda p: p["call"]):
      with open(parts / piece["file"], "rb") as src:
        for block in iter(lambda: src.read(1 << 22), b""):
          sent.update(block)
          out.write(decompressor.decompress(block) if decompressor else block)
  if sent.hexdigest() != manifest["sha256"]:
    tmp.unlink()
    raise LeaseError(f"the joined {name} differs from the staged one (sha256): stage again "
                     f"here and repeat every call")
  os.replace(tmp, path)
  return path


# ---------------------------------------------------------------- the rules, played here


class Rehearsal:
  """A lease's calls played on this machine under the device's rules (module docstring):
  each call runs in a fresh copy of the working tree with only the paths it carries, a /tmp
  of its own that lasts from call to call ($TLT_LEASE_TMP), and an $OUT whose files must fit
  what comes back. RuleBroken when a call carries too much or leaves too much in $OUT."""

  def __init__(self, root: pathlib.Path, limit: int = CALL_LIMIT):
    self.root, self.limit = root, limit
    self.tmp = root / "device_tmp"
    self.tmp.mkdir(parents=True, exist_ok=True)
    self.calls = 0
    self.files = tree_files()

  def call(self, command: str, carry: dict[str, pathlib.Path] = (), timeout_s: float = 600,
           env: dict | None = None) -> tuple[int, str, list[pathlib.Path]]:
    """Runs `command` as a device call carrying `carry` (path in the repository -> the local
    file or folder it is copied from); returns (exit status, output, the files of $OUT)."""
    self.calls += 1
    work = self.root / "device_repo"
    shutil.rmtree(work, ignore_errors=True)  # what the last call carried is gone
    carried = dict(carry)
    size = sum((REPO / f).stat().st_size for f in self.files)
    size += sum(f.stat().st_size for src in carried.values()
                for f in ([src] if src.is_file() else src.rglob("*")) if f.is_file())
    if size > self.limit:
      raise RuleBroken(f"call {self.calls} carries {size / MiB:.1f} MiB with the working "
                       f"tree; a call carries {self.limit / MiB:.0f} MiB")
    for f in self.files:
      (work / f).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(REPO / f, work / f)
    for dest, src in carried.items():
      (work / dest).parent.mkdir(parents=True, exist_ok=True)
      (shutil.copytree if src.is_dir() else shutil.copy2)(src, work / dest)
    out = self.root / f"out{self.calls}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    proc = subprocess.run(["bash", "-c", command], cwd=work, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **(env or {}),
                                                  "TLT_LEASE_TMP": str(self.tmp),
                                                  "OUT": str(out)})
    files = [f for f in out.rglob("*") if f.is_file()]
    if len(files) > MAX_FILES:
      raise RuleBroken(f"call {self.calls} left {len(files)} files in $OUT; {MAX_FILES} come "
                       f"back")
    for f in files:
      if f.stat().st_size > FILE_LIMIT:
        raise RuleBroken(f"call {self.calls}: $OUT/{f.relative_to(out)} is "
                         f"{f.stat().st_size / MiB:.1f} MiB; a file comes back up to "
                         f"{FILE_LIMIT / MiB:.0f} MiB")
      if len(f.relative_to(out).parts) > 3:
        raise RuleBroken(f"call {self.calls}: $OUT/{f.relative_to(out)} is deeper than "
                         f"$OUT/a/b/file")
    return proc.returncode, proc.stdout + proc.stderr, files


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("check", help="(on the device) the parts of calls 1..CALL have arrived")
  p.add_argument("--parts", type=pathlib.Path, required=True)
  p.add_argument("--call", type=int, required=True)
  args = parser.parse_args(argv)
  t = time.perf_counter()
  try:
    manifest = verify(args.parts, args.call)
  except LeaseError as e:
    sys.exit(f"check: {e}")
  arrived = sum(p["call"] <= args.call for p in manifest["parts"])
  print(f"check: {arrived} parts of calls 1..{args.call} of {manifest['calls']} verified in "
        f"{args.parts} ({time.perf_counter() - t:.1f} s)" + (
            "" if args.call == manifest["calls"] else
            f"; now call {args.call + 1}, within 30 s of this one's end"), flush=True)


if __name__ == "__main__":
  main()
