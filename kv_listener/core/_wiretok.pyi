"""Types of the C module `_wiretok.c` (optional: core/decode_events.py falls back without it)."""

from array import array

def u32_array(raw: object) -> array[int] | None: ...
