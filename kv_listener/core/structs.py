"""Bases for the msgspec Structs of the compiled core modules: this module is not compiled.

mypyc drops the keywords of a class statement (python/mypy#21938, open): compiled,
`class Record(msgspec.Struct, frozen=True, gc=False)` made a mutable, unhashable Struct that the
cyclic GC tracks (16 bytes more for each, and one more object for every collection to walk: the
event log's history holds up to 100,000 records, its live state one entry per prefix). msgspec
passes a base's options on to its subclasses, so the Structs of setup.py's compiled modules
derive from these, whose options this uncompiled module keeps; tests/test_native.py checks that
each of them has the options it was declared with.
"""

from __future__ import annotations

import msgspec


class FrozenStruct(msgspec.Struct, frozen=True, gc=False):
    """Immutable and hashable; not tracked by the cyclic GC (it holds no containers of its own
    that could close a cycle)."""


class UntrackedStruct(msgspec.Struct, gc=False):
    """Mutable; not tracked by the cyclic GC: for values that hold only scalars, strings and
    enum members."""


def fields_in_order(cls: type[msgspec.Struct], fields: tuple[str, ...]) -> tuple[str, ...]:
    """`fields`, once checked to be `cls`'s fields in declaration order: for hot paths that read
    a Struct's fields as one `msgspec.structs.astuple` tuple and unpack it by position. Raises
    ImportError at the importing module's load when a field was added, removed or moved."""
    if cls.__struct_fields__ != fields:
        raise ImportError(f"{cls.__qualname__}'s fields are {cls.__struct_fields__}, not {fields}:"
                          " update the positional reads of its astuple tuple")
    return fields
