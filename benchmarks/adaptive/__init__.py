"""The adaptive block length: the controller against every fixed n_max and the target alone,
live and replayed, and what would gate a draft.

    python -m benchmarks.adaptive COMMAND --help
"""
