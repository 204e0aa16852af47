"""Benchmarks: commands that print figures (JSON and a table), never timed assertions."""
