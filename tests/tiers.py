"""Marks for the two test tiers (see conftest.py): the default run keeps representative cases, `full` adds the
extended sweeps (DSV4_FULL_TESTS=1; on by default on a GPU machine)."""

import pytest

full_tier = pytest.mark.full


class core(tuple):
    """A parametrize case kept in the default tier inside `sweep` (its values, as a tuple)."""

    def __new__(cls, *values):
        return super().__new__(cls, values)


def full(*values, id=None):
    """One parametrize case that runs only in the full tier."""
    return pytest.param(*values, marks=pytest.mark.full, id=id)


def sweep(cases):
    """A long parametrize list: the cases wrapped in `core(...)` run in every tier, the plain tuples only in the
    full tier."""
    return [pytest.param(*c) if isinstance(c, core) else full(*c) for c in cases]
