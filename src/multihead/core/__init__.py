"""The exact core: masks and biases (small predicates, materialised late), the validated ``Problem``, its
tile grid, the shared numerics and argument checks, and ``attention()`` itself (``functional``).
"""
