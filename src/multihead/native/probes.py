"""What the native threads cost to meet: :func:`round_trip_ns` (``products.c``'s ``mh_thread_round_trip``)."""

from __future__ import annotations

import ctypes

__all__ = ["round_trip_ns"]


def round_trip_ns(lib: ctypes.CDLL, n: int = 20000) -> float | None:
    """Nanoseconds of one round trip of a cache line between the first two native threads (the median
    of 7 batches of ``n``): what each meeting of a product's threads costs at least, and where a virtual
    machine's host put its virtual CPUs (one core complex: tens of ns; two: hundreds). None with fewer
    than two threads (:func:`torch.get_num_threads`), or from a library built before the function.

    Raises:
        ValueError: ``n`` < 1.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int (round trips per batch), got {n!r}")
    trip = getattr(lib, "mh_thread_round_trip", None)
    if trip is None:  # a library built from sources older than the function
        return None
    ns = float(trip(n))
    return None if ns < 0 else ns
