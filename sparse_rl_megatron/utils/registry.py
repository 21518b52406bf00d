"""Small name -> object registries, so every choice in a config is made by name.

An unknown name raises ``UnknownNameError`` listing the valid names; registering a name twice is refused.
A config field chosen from an open registry (one a plug-in may add names to: estimators, modes, engines, scorers,
rewards, templates, tasks) is typed ``str``, the registry being the list of valid names; a fixed choice is typed
``Literal`` (for a closed registry, such as the layer specs, a test keeps the two equal).
Imports only the standard library, so the torch-only packages (``algo``, ``compression``) may use it.
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """A name that is not in a registry. Subclasses both KeyError and ValueError for callers' convenience."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


class Registry(Generic[T]):
    """A named collection of implementations of one kind (e.g. ``"advantage estimator"``).

    >>> ESTIMATORS = Registry("advantage estimator")
    >>> @ESTIMATORS.register("grpo")
    ... def grpo(...): ...
    >>> ESTIMATORS.get("grpo")
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            self.add(name, obj)
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        if name in self._items:
            raise ValueError(f"{self.kind} '{name}' is already registered")
        self._items[name] = obj

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} '{name}'; valid names: {', '.join(sorted(self._items))}"
            ) from None

    def check(self, name: str, field: str | None = None) -> str:
        """Return ``name`` if registered, else raise naming the config ``field`` and the valid names."""
        if name not in self._items:
            where = f"{field}: " if field else ""
            raise UnknownNameError(
                f"{where}unknown {self.kind} '{name}'; valid names: {', '.join(sorted(self._items))}"
            )
        return name

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
