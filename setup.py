"""Packaging lives in setup.cfg; this file lets `pip install -e .` work with older tooling."""
from setuptools import setup

setup()
