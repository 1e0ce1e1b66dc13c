"""Pallas GPU kernels of lucebox_jax (see README.md in this folder for the weight format and op contracts)."""
