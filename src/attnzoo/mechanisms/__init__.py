"""One module per family; importing this package imports every module in it, and each module
registers its mechanisms. A new family member is a new module here plus its test — nothing
else needs to list it."""

import importlib
import pkgutil

from attnzoo.mechanisms.base import Attention, TokenMixer

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Attention", "TokenMixer"]
