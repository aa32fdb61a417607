"""llama-server: the speculative loop's overhead, A/B against another build, throughput under
load, slot paths, the first command's comparison, and a server beside a busy process.

    python -m benchmarks.server COMMAND --help
"""
