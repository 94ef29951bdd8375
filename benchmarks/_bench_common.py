"""What the benchmark scripts share. They run as ``python benchmarks/bench_X.py`` from the repository root, which
puts this directory on ``sys.path``: import it as ``from _bench_common import ...``."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of ``fn()`` in ms over ``repeat`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def import_flashinfer():
    """``(flashinfer, None)``, or ``(None, reason)`` when FlashInfer does not import; the reason is printed
    because the script then times pagedkv alone rather than failing."""
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - report any import failure and time ours alone
        reason = f"{type(exc).__name__}: {exc}"
        print(f"FlashInfer not importable ({reason}): timing pagedkv only", flush=True)
        return None, reason
    return flashinfer, None


def launch_in_profiler_range(launch: Callable[[], object], launches: int, torch) -> None:
    """What the profile_*.py scripts run: ``launch()`` once outside the profiler range (lazy set-up: plans, JIT loads,
    attributes), then ``launches`` times inside cudaProfilerStart / Stop, so that ``ncu --profile-from-start off``
    sees only those."""
    launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(launches):
        launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
