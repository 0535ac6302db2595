"""Deprecated: the model holders live in butter.server.holders (FixedHolder,
SwappableHolder, ModelHolder); "backend" names the model library below the engine."""

from __future__ import annotations

import warnings

from butter.server.holders import FixedHolder as ButterServeBackend
from butter.server.holders import Loader, catalog_precheck
from butter.server.holders import ModelHolder as ServeBackend
from butter.server.holders import SwappableHolder as ResidentServeBackend

__all__ = ["ButterServeBackend", "Loader", "ResidentServeBackend", "ServeBackend",
           "catalog_precheck"]

warnings.warn("butter.server.backends is now butter.server.holders", DeprecationWarning,
              stacklevel=2)
