"""Quantized weights: the int8 weight-only format, its kernels' twins, and how closely a quantized
model follows its float one (agreement.py)."""
