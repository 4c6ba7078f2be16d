"""Fixtures of the distributed tests: a ``safe_open`` stand-in that counts what a loader reads."""

from __future__ import annotations

import math

import pytest
from safetensors import safe_open


class _Slice:
    def __init__(self, s, owner):
        self.s, self.owner = s, owner

    def __getitem__(self, index):
        t = self.s[index]
        self.owner.read += t.numel()
        return t

    def get_shape(self):
        return self.s.get_shape()


class _Handle:
    def __init__(self, fh, owner):
        self.fh, self.owner = fh, owner

    def keys(self):
        return self.fh.keys()

    def get_tensor(self, name):
        self.owner.whole.append(name)
        return self.fh.get_tensor(name)

    def get_slice(self, name):
        return _Slice(self.fh.get_slice(name), self.owner)


class _Opened:
    def __init__(self, cm, owner):
        self.cm, self.owner = cm, owner

    def __enter__(self):
        return _Handle(self.cm.__enter__(), self.owner)

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


class CountingSafeOpen:
    """Call it as ``safe_open``; ``read`` counts the elements read through slices, ``whole`` names
    the tensors read whole (``get_tensor``)."""

    def __init__(self) -> None:
        self.read, self.whole = 0, []

    def __call__(self, *args, **kwargs):
        return _Opened(safe_open(*args, **kwargs), self)


def _checkpoint_elements(path) -> int:
    """Elements of every tensor in ``path/model.safetensors``."""
    with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
        return sum(math.prod(fh.get_slice(name).get_shape()) for name in fh.keys())


@pytest.fixture
def counting_safe_open():
    """A fresh ``CountingSafeOpen`` (patch it in where the loader looks ``safe_open`` up)."""
    return CountingSafeOpen()


@pytest.fixture
def checkpoint_elements():
    """``checkpoint_elements(path)``: elements of every tensor in ``path/model.safetensors``."""
    return _checkpoint_elements
