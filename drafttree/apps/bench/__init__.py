"""Benchmarks: `drafttree bench` (decoding methods side by side) and friends."""
