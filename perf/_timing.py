"""The quick perf/ scripts' names for pagedattn/bench/timing.py, the one timer module."""
from pagedattn.bench.timing import copy_ceiling_gbs, median_us  # noqa: F401
