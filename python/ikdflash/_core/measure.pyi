"""ikdflash._core.measure: pass timings, memory bandwidth and requantizing, for benchmarks."""

from . import Model

def time_passes(model: Model, n_rows: list[int], n_context: int, repeats: int) -> list[list[float]]:
    """For each row count, milliseconds of `repeats` target passes of that many rows (every row's
    logits kept) after n_context cached tokens; the rows are dropped after each pass, and the
    counts take turns within each round."""
def time_pass_ops(model: Model, n_rows: list[int], n_context: int, repeats: int) -> list[list[dict[str, float]]]:
    """As time_passes, each pass split by operation: per row count, one {operation: ms} per pass.
    The graph is computed a node at a time, so each node also pays a thread pool's start: compare
    row counts operation by operation."""
def memory_read_bandwidth(n_threads: int, mib: int = 1024, repeats: int = 5) -> float:
    """GB/s read by n_threads threads summing a buffer of `mib` MiB (best of repeats)."""
def quantize(src: str, dst: str, type: str, n_threads: int = 0) -> None:
    """Requantize the GGUF at src to dst: Q4_0, Q4_1, Q8_0, Q4_K_M, Q6_K, IQ4_NL or IQ4_XS."""
