"""Helpers of scripts/bench_peers.py: the Fixing and Exactness tables (issue 9)."""
