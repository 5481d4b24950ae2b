"""Diagnostics: `jdp explain`, the communication and memory reports, the replica check, the
exactness check against one device and the pytest plugin behind `jdp.testing`.
"""
