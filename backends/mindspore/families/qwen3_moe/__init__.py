"""Qwen3-MoE: its registry entry (entry.py) and its expert layers and networks on both kernel paths (network.py)."""
