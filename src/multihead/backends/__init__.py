"""Backends: one registry (:mod:`.registry`), one signature, BHSD in and out; ``auto`` (:mod:`.auto`) picks
one per call and says why. ``reference`` (float64 oracle), ``matrix``, ``sdpa``, ``tiled`` (own
block-sparse kernel: :mod:`.tiled`), ``decode`` (few query rows) and, where enabled, ``flex``.
"""
