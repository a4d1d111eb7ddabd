"""Token dispatch/combine backends behind one interface (see ``base.Dispatcher``)."""

from .base import Dispatcher
from .local import LocalDispatcher

__all__ = ["Dispatcher", "LocalDispatcher"]
