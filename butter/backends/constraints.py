"""Output constraints compiled once per distinct constraint, whatever the backend."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from butter.sampling import OutputConstraint

GRAMMAR_CACHE_SIZE = 32  # compiled grammars kept (agents resend the same tools each turn)

Compiled = TypeVar("Compiled")


class CompiledConstraints(Generic[Compiled]):
    """The last few constraints' compiled forms, shared by every thread that prepares
    requests and by the backend's own thread."""

    def __init__(self, compile: Callable[[OutputConstraint], Compiled],
                 size: int = GRAMMAR_CACHE_SIZE) -> None:
        """`compile` raises ValueError (a message for the client) for an unusable one."""
        self._compile = compile
        self._size = size
        self._lock = threading.Lock()
        self._compiled: OrderedDict[OutputConstraint, Compiled] = OrderedDict()

    def get(self, constraint: OutputConstraint) -> Compiled:
        """The compiled constraint, compiled now if it is not kept (errors are not kept)."""
        with self._lock:
            if constraint in self._compiled:
                self._compiled.move_to_end(constraint)
                return self._compiled[constraint]
        compiled = self._compile(constraint)  # outside the lock: other requests go on
        with self._lock:
            self._compiled[constraint] = compiled
            self._compiled.move_to_end(constraint)
            while len(self._compiled) > self._size:
                self._compiled.popitem(last=False)
        return compiled
