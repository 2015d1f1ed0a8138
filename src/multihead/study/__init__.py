"""Application: ``multihead study`` - the report (``run``), its shared types (``context``), figures and
HTML, and one file per section under ``sections/``. Imports the library; the library never imports it.
"""
