"""Several engines at once: a pool of engine processes driven over pipes."""
