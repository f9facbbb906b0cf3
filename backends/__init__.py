"""Backends: the model-facing half of mindserve (no HTTP here)."""
