"""Gemma 3 text: its registry entry and config reader (entry.py) and its networks on both kernel paths
(network.py)."""
