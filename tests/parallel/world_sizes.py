"""The process counts a parallel group's tests run at when they carry no mark of their own.

A group's conftest calls :func:`mark_unmarked` from a ``tryfirst`` collection hook, before
tests/parallel/conftest.py deselects by ``pytest.mark.world_sizes``: a test whose subject does not
change with the process count runs once or twice, not at every count the group is launched at,
and a module that needs another set of counts says so with its own ``pytestmark``.
"""
import pytest


def mark_unmarked(items, *counts):
    """Give every test without a ``world_sizes`` mark of its own ``world_sizes(*counts)``."""
    for item in items:
        if item.get_closest_marker("world_sizes") is None:
            item.add_marker(pytest.mark.world_sizes(*counts))
