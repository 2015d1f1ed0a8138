"""The ``tiled`` backend: the plan (tiles classified once, cut into pieces), the pieces run on torch's fused
CPU flash kernel and merged by log-sum-exp (``fused``), and the portable loop engine (``loop``).
"""
