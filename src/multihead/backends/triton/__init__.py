"""``triton``: the library's own GPU kernels (forward and backward), fed by the mask's tile plan.

``plan`` turns the mask into data (tile lists, partial-tile bit masks), ``launch`` the biases and block
sizes, ``forward`` / ``backward`` are the kernels, ``function`` the autograd wrapper and ``backend`` the
registry entry. Importing this package does not import Triton; the kernels are imported on first use.
"""
