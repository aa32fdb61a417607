"""A slice of tests/soak.py (the full soak is its own command, see CONTRIBUTING.md): llama-server with
DFlash on 2 slots keeps the target's choice of every token, error-free and flat in memory under concurrent requests with
hang-ups, and `ikdflash serve` never leaves a server or a busy port behind, however it stops."""

from __future__ import annotations

from soak import soak_cycles, soak_requests


def test_concurrent_requests_with_hang_ups(swa_pairs, tmp_path):
    soak = soak_requests(*swa_pairs["llama"], n_requests=40, seed=7, folder=tmp_path)
    assert soak.requests == 40 and soak.cancelled >= 2
    assert not soak.errors and not soak.mismatches, soak.errors + soak.mismatches
    # an F32 model rounds alike in any batch but for near-ties: only those may turn
    assert all(gap < 0.02 for _, gap in soak.diverged), soak.diverged
    # A leak per request shows as steady growth; the allocator's arenas step up once in a while
    # (one CI run: +3.2 MiB of 60 MiB in one step at request 35, flat after). The 5% bound is the
    # full soak's, on SmolLM2 over 200 requests; this 40-request slice on a tiny model allows 8%.
    assert soak.rss_growth < 0.08, (soak.rss_warm_kib, soak.rss_end_kib)


def test_serve_stopped_every_way_leaves_nothing_behind(swa_pairs, tmp_path):
    cycles = soak_cycles(*swa_pairs["llama"], n_cycles=8, seed=3, folder=tmp_path)
    assert cycles.cycles == 8 and len(cycles.by_stop) >= 3
    assert cycles.ok, cycles
