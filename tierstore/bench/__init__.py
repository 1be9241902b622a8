"""Benchmarks and the demo model shipped with tierstore."""
