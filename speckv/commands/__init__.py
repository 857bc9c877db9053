"""The `speckv` subcommands that are not benchmarks: presentation only (arguments, printing).

Each module exposes `add_arguments(parser)` / `run(args) -> int` (or `add_X_arguments` /
`run_X` pairs); `speckv.cli` mounts them. User errors are `ValueError` /
`FileNotFoundError`, printed by `speckv.cli` as one line, exit 2.
"""
