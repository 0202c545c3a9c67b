"""What a benchmark prints on stdout is its figures: the libraries' chatter is silenced, and what
is left (warnings and errors, ours included) goes to stderr.

Every bench script calls `quiet_libraries()` first in its entry point, before transformers is
imported (the tokenizer loads lazily):

- transformers logs an advisory on import when PyTorch is missing ("PyTorch was not found.
  Models won't be available ..."): the benches use its tokenizers only, never a model. Its other
  warnings still reach stderr.
- tokenizers warns, once per forked child, that its parallelism was used before the fork.
- The project's components that run inside a bench process (simulated engines, `/detokenize`
  servers, the resolver, the router) log through structlog, whose default writes every level to
  stdout, between the figures (`detokenize_server_listening`, `chat_template_learned`, ...):
  here they log warnings and errors only, to stderr.
- Libraries logging through stdlib `logging` (aiohttp, asyncio, hypercorn, redis): warnings
  and errors, to stderr, one line each.
- Python warnings keep Python's own filters (DeprecationWarning shown only for the bench
  script itself, ResourceWarning only under `-W` / `PYTHONWARNINGS` / `-X dev`) and go to
  stderr as always: a warning about our own code is not hidden.

Child processes (the listener daemon, peer routers) inherit the environment part; their logs go
wherever each bench sends them (a pipe it reads, a file), never to this stdout.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the tokenizer ships
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="%H:%M:%S"),
                    structlog.processors.format_exc_info,
                    structlog.dev.ConsoleRenderer(colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True,
                        format="%(levelname)s %(name)s: %(message)s")
