"""`eager_when_compiled`: torch.compiler.disable without importing dynamo when the module that uses it is imported."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def eager_when_compiled(fn: F) -> F:
    """`fn` run eagerly inside compiled code, as `@torch.compiler.disable` runs it (a graph break at the call).

    Decorating with torch.compiler.disable imports dynamo at once: seconds of every rank's start-up, a restarted
    replica group's among them, in runs that compile nothing. Code is compiled only once dynamo is loaded, so until
    then the plain function is the same; after that, calls go through torch.compiler.disable(fn), made once. The
    marker below keeps dynamo from inlining this wrapper, as it keeps it from inlining torch.compiler.disable's."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]
