"""The scale group: the exchange engine at 8 ranks (or up to 32) on recorded selections of real
training (docs/results/data/oktopk-scale/selections.npz, 32 simulated ranks). Run by
scripts/run_tests.py at -np 8 only (PARALLEL_GROUPS): the other groups stay at
small P. The exchange group's helpers are shared (tests/parallel/exchange/exchange_helpers.py)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "exchange"))
