"""The ``tiled`` backend (:mod:`.backend`): the plan (tiles classified once, cut into pieces: ``plan``),
the pieces run on torch's fused CPU flash kernel (``fused``) and merged by log-sum-exp (``merge``), and
the portable loop engine (``loop``).
"""
