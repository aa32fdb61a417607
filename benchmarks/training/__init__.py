"""Training: held-out acceptance along a run's snapshots, and how fast training data is made.

    python -m benchmarks.training COMMAND --help
"""
