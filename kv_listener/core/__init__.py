"""Pure core: decoding, sequencing, tracking, prefix keys, event log. No I/O, no clocks."""
