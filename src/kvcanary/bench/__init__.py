"""Benchmarks behind ``kv-canary bench``: kernel microbenchmarks (``ops``) and the end-to-end
overhead study (``overhead``), sharing CUDA-graph replay timing and bandwidth floors (``timing``)."""
