"""The LoRA adapters a server knows by name (issue 43): ``--lora-modules`` at start-up, vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` at run time, and the ``model`` field of a
request naming one.

A request whose ``model`` is an adapter's name runs with its ``LoRARequest`` (several adapters and the
base model share each step); ``/v1/models`` lists each adapter with its parent (the base model) and
its directory as ``root``. An adapter is checked when it is added (its directory read, its rank and
shapes against the base model: ``lora.checker.AdapterChecker``), so a bad one is a 400 naming why
and is never served. Unloading takes the name away from new requests only: a request already running
keeps its adapter, which the runner keeps in memory until that request ends
(``worker.lora_slots.LoRASlots``). Ids are never reused, so an adapter loaded again under the same
name is a new adapter (its own prefix-cache blocks).

Source: vLLM's ``OpenAIServingModels`` (the routes, their bodies and answers, the runtime switch
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) as documented.
"""

from __future__ import annotations

import threading

from pagedllm.lora.request import LoRARequest


class LoRAAdapters:
    """Adapters by name, case-insensitively, as a server serves them.

    Args:
        base_name: the served base model's name (an adapter may not take it).
        checker: the engine's ``AdapterChecker`` (``None``: the engine has no ``enable_lora``).
    """

    def __init__(self, base_name: str, checker) -> None:
        self.base_name, self.checker = base_name, checker
        self._by_name: dict[str, LoRARequest] = {}
        self._next_id = 1
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether the engine serves adapters at all (``--enable-lora``)."""
        return self.checker is not None

    def get(self, name: str) -> LoRARequest | None:
        """The adapter named ``name`` (``None``: no such adapter)."""
        return self._by_name.get(name.casefold())

    def all(self) -> list[LoRARequest]:
        """Every adapter, in the order they were added."""
        return list(self._by_name.values())

    def add(self, name: str, path: str) -> LoRARequest:
        """Check and add an adapter (blocking: its directory is read; call it off the event loop).

        Raises:
            ValueError: adapters are off, an empty name or path, the base model's name, a name
                already taken, or a directory the check refuses (the message names why).
        """
        if not self.enabled:
            raise ValueError("LoRA adapters need a server started with --enable-lora")
        if not name or not path:
            raise ValueError("lora_name and lora_path must not be empty")
        if name.casefold() == self.base_name.casefold():
            raise ValueError(f"lora_name: {name!r} is the base model's name")
        with self._lock:
            if name.casefold() in self._by_name:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            lora = LoRARequest(name, self._next_id, path, base_model_name=self.base_name)
            self._next_id += 1
        self.checker.check(lora)
        with self._lock:
            if name.casefold() in self._by_name:  # added meanwhile by another request
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            self._by_name[name.casefold()] = lora
        return lora

    def remove(self, name: str, lora_int_id: int | None = None) -> LoRARequest:
        """Take an adapter's name away from new requests (running ones keep it).

        Raises:
            KeyError: no adapter of that name (and that id, when given).
        """
        with self._lock:
            lora = self._by_name.get(name.casefold())
            if lora is None or (lora_int_id is not None and lora.lora_int_id != lora_int_id):
                raise KeyError(name)
            del self._by_name[name.casefold()]
        return lora

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        """Each adapter as a ``/v1/models`` entry: its name, its directory as ``root``, the base model
        as ``parent``."""
        return [{"id": a.lora_name, "object": "model", "created": created, "owned_by": "pagedllm",
                 "root": a.lora_path, "parent": self.base_name, "max_model_len": max_model_len} for a in self.all()]
