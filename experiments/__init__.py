"""The benchmarks and figure experiments. Each is a module run from the repository root:
`python -m experiments.<name> --help` (so `tlt_jax`, `configs` and `experiments` are imported from
the working tree, installed or not). `experiments.common` holds what they share (run records,
JSON written atomically, flags), `experiments.stages` runs a campaign of them."""
