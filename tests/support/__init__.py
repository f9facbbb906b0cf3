"""Helpers the tests share (not tests): tests import from here, never from each other."""
