"""What `speckv demo` and the benches measure: product code, no command line.

`hit_length.py` (cached tokens of a repeated prompt on the real cache manager), `hash_cost.py`
(the CPU cost of each block-hash format), `prefix_repetition.py` (vLLM's prefix_repetition
workload through the real engine, per mode), `prometheus.py` (a server's `/metrics` totals).
The commands in `speckv/bench` and `speckv/commands` print them.
"""
