"""Private memory (RssAnon) of this process: its value, its peak over a block (sampled), and glibc set to give freed
tensors back at once, so that the load, save and checkpoint tests measure what one operation holds."""
from __future__ import annotations

import threading

MB = 2**20
CONSTANT = 16 * MB  # allocator slack, Python objects made while loading


def pin_mmap_threshold(threshold: int = 64 * 1024) -> None:
    """Make glibc map every allocation over `threshold` on its own and unmap it when freed, so a freed tensor
    leaves RssAnon at once and cannot hide (or inflate) a later one. Called in the rank itself: a rank forked
    from the test fork server inherits that server's malloc settings, not the test's MALLOC_MMAP_THRESHOLD_;
    glibc's dynamic threshold then keeps freed tensors in the heap and the measured rise depends on which tests
    ran before."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD (setting it also stops glibc's dynamic adjustment)
    libc.malloc_trim(0)  # what the heap already holds free goes back to the OS now


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """Highest RssAnon seen while the block runs (sampled every 0.5 ms; torch copies release the GIL)."""

    def __enter__(self) -> "PeakSampler":
        self.peak, self._stop = rss_anon(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.0005):
            self.peak = max(self.peak, rss_anon())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())
