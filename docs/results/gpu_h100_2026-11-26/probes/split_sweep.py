"""Which (S, T, k_splits, warps, stages) make the split kernel wrong on this GPU."""
import json, os, sys, time, functools
import jax, jax.numpy as jnp
sys.path.insert(0, "experiments")
from tlt_jax.kernels.tree_attention_pallas import prefix_tree_attention_pallas
import bench_tree_attention as b
interp = jax.default_backend() != "gpu"
out_path = os.path.join(os.environ.get("OUT", "/tmp"), "kcheck.json")
base = b.make_inputs(jax.random.PRNGKey(0), 4, 16384, 16, 28, 4, 128, jnp.bfloat16)
cases = []
# the split-count sweep at the first failing shape
for ks in (1, 16, 20, 21, 22, 23, 24, 25, 32):
  cases.append((1, 8192, 8, ks, None, 2))
# the failing points with other compiler params
for (S, ks) in ((8192, 22), (16384, 43)):
  for w, st in ((4, 1), (8, 2), (8, 1), (4, 3)):
    cases.append((1, S, 8, ks, w, st))
# T between 1 and 16 at 22 splits; B=2 and 4 at 22 splits
for t in (2, 4, 7, 9, 12, 16):
  cases.append((1, 8192, t, 22, None, 2))
for bb in (2, 4):
  cases.append((bb, 8192, 8, 22, None, 2))
cases.append((1, 16384, 8, 43, None, 2))  # repeat: deterministic?
if interp:
  cases = cases[:3]
res = []
t0 = time.time()
for (B, S, T, ks, w, st) in cases:
  if time.time() - t0 > 150: break
  inp = b.slice_inputs(base, B, S, T)
  f = jax.jit(functools.partial(prefix_tree_attention_pallas, k_splits=ks, num_warps=w,
                                num_stages=st, interpret=interp))
  errs = []
  try:
    for _ in range(3):
      out = jax.block_until_ready(f(*inp))
      err, fin = b._check_rows(inp, out, tuple(sorted({0, B - 1})))
      errs.append(round(float(err), 5))
    status = "ok"
  except Exception as e:
    status = f"{type(e).__name__}: {str(e)[:200]}"
  r = dict(B=B, S=S, T=T, ks=ks, warps=w, stages=st, errs=errs, status=status)
  res.append(r); print(r, flush=True)
  json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, rows=res),
            open(out_path, "w"), indent=1)
print("done", round(time.time() - t0, 1))
