"""llama-server: the speculative loop's overhead, A/B against another build, throughput under
load, slot paths, and the first command's comparison.

    python -m benchmarks.server COMMAND --help
"""
