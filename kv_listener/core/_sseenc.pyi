"""Types of the C module `_sseenc.c` (optional: core/sse.py falls back without it)."""

from collections.abc import Callable, Sequence
from typing import Any

class Encoder:
    def __init__(self, record_type: type, event_type: type, cleared: Any, created: Any,
                 offloaded: Any, tier_text: dict[Any, str], head_of: Callable[[Any, Any], str],
                 tail_of: Callable[[float], str | None],
                 fallback: Callable[[Any], bytes]) -> None: ...
    def encode_list(self, records: Sequence[Any]) -> list[bytes]: ...
