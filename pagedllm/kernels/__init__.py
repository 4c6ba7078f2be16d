"""Compute kernels the torch reference paths can hand work to (see ``cpu``)."""
