"""Application: the ``multihead`` command line, one file per command (``main`` builds the parser) and the
shared console helpers. Imports the library; the library never imports it.
"""
