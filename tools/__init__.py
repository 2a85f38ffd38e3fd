"""Tools that are not experiments: the GPU memory budget, the GPU numerics check and the
comparison with an earlier revision. Each runs from the repository root as
`python -m tools.<name> --help`."""
