"""Pass costs and kernels: target passes by row count, weight type, operation and build; the
draft step and its cross-context; the layer capture; the CUDA build's cost.

    python -m benchmarks.passes COMMAND --help
"""
