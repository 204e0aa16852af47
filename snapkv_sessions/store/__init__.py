"""The raw store: the source of truth every evicted KV can be rebuilt from (SQLAlchemy, Redis).

This subpackage never imports torch, so workers that only read or audit sessions stay light.
"""
