"""Whole models built from :mod:`multihead.nn`: the language model (``TransformerLM``) and quantisation."""
