"""Application: measurements (``multihead bench``, the approximations' quality and cost, distributed
attention, MoH's inference saving). Imports the library; the library never imports it.
"""
