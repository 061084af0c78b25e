"""Swap a library's module-level function for quantkit's while a call runs, and put it back after.

Used only where quantkit does the same work as a library function with less memory
(quantkit.methods.lean_hessian for llm-compressor's GPTQ, quantkit.shards.save_file for the
safetensors writes transformers makes). Each site is looked up by module and name; a name that is
gone (an upgrade moved it) raises before anything is swapped, and the test suite checks every site.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Callable, Iterator

Site = tuple[str, str]  # (module, function name) whose global the library calls through


def site_function(site: Site) -> Callable:
    module_name, name = site
    function = vars(importlib.import_module(module_name)).get(name)
    if not callable(function):
        raise AttributeError(f"{module_name}.{name} no longer exists")
    return function


@contextmanager
def swapped(replacements: dict[Site, Callable]) -> Iterator[None]:
    """Each site's function replaced by its replacement while inside; the originals restored on exit."""
    originals = {site: site_function(site) for site in replacements}
    try:
        for (module_name, name), function in replacements.items():
            setattr(importlib.import_module(module_name), name, function)
        yield
    finally:
        for (module_name, name), function in originals.items():
            setattr(importlib.import_module(module_name), name, function)
