"""Commands that time nothing: the memory budget XLA assigns a config's GPU programs (compiled
here, never run) and the knob reference of docs/configs.md. Each runs from the repository root
as `python -m tools.<name> --help`."""
