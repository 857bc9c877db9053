"""Training the built-in drafter: self-distillation data through the engine (`distill.py`) and
EAGLE3 training with training-time test (`train.py`, `speckv train-draft`).

Sits above the engine (it runs the engine to generate data), beside `speckv.bench`; the drafters
it trains live in `speckv.drafters`, which never import this package.
"""
