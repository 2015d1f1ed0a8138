"""Application: the MQAR trainer behind ``multihead train`` and the study's design comparisons."""
