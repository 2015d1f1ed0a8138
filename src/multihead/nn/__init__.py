"""Modules that hold parameters and state around the core: ``MultiHeadAttention`` (the template every head
design specialises), the feed-forward block, norms, positions, the KV cache, layers and the
``torch.nn.MultiheadAttention`` drop-in (``compat``).
"""
