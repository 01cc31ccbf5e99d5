"""Benchmarks: ray_lightning's strategies against Lightning's own DDP and Ray Train, on one workload.

``python -m benchmarks.run`` (see ``benchmarks/README.md``) measures every contender in fresh
driver processes and writes a markdown and a JSON table.
"""
