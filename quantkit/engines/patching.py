"""Swap a library's function (module-level, or a method of one of its classes) for quantkit's while
a call runs, and put it back after.

Used only where quantkit does the same work as a library function with less memory or where the
library is wrong for quantkit's case, each one documented at its site: quantkit.engines.llmcompressor.lean_hessian
(llm-compressor's GPTQ), quantkit.io.shards.save_file (the safetensors writes transformers makes),
quantkit.engines.llmcompressor.distributed (a barrier in distributed GPTQ), quantkit.methods.awq (pin_memory on CPU) and
quantkit.engines.llmcompressor.llmc (a subgraph's weights held onloaded, with the layers on disk on CPU).
A site is (module, attribute): a function's name, or "Class.method". A site that is gone (an
upgrade moved it) raises before anything is swapped, and the test suite checks every site.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator

Site = tuple[str, str]  # (module, "function" or "Class.method") the library calls through


def site_owner(site: Site) -> tuple[Any, str]:
    """The module or class that holds the site's attribute, and the attribute's name."""
    module_name, path = site
    *classes, name = path.split(".")
    owner = importlib.import_module(module_name)
    for class_name in classes:
        owner = vars(owner).get(class_name)
        if not isinstance(owner, type):
            raise AttributeError(f"{module_name}.{path}: {class_name} no longer exists")
    return owner, name


def site_function(site: Site) -> Callable:
    owner, name = site_owner(site)
    function = vars(owner).get(name)
    if not callable(function):
        raise AttributeError(f"{site[0]}.{site[1]} no longer exists")
    return function


@contextmanager
def swapped(replacements: dict[Site, Callable]) -> Iterator[None]:
    """Each site's function replaced by its replacement while inside; the originals restored on exit."""
    originals = {site: site_function(site) for site in replacements}
    try:
        for site, function in replacements.items():
            setattr(*site_owner(site), function)
        yield
    finally:
        for site, function in originals.items():
            setattr(*site_owner(site), function)
