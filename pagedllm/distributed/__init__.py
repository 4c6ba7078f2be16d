"""Distributed execution: process groups (``parallel_state``) and executors (``executor``)."""
