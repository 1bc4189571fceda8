"""Measuring the machine: the hardware profile `nanoflex profile` caches (`profiler.py`) and
its parts (dense steps, disk bandwidth, nano-batch overlap, the timing helpers). Beside the
executor, not in it: a profiler builds executors and times them."""
