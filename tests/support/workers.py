"""How pytest-xdist shares the suite among its workers (`-n` in pyproject's addopts).

Work units, decided from the node ids alone on the controller:

- every test under tests/engines/ but SGLang's module is one unit: the real vLLM CPU engines
  run on one worker, never two engine boots at once on the two cores;
- tests/engines/test_sglang_real.py is one unit of its own: SGLang's real publisher and radix
  tree in one light driver process (no model, no engine boot) under a module-scoped fixture; kept
  beside the vLLM unit it made that worker the suite's long pole (about 70 s of its 170 s);
- each module of `WHOLE_MODULES` is one unit: its tests share one expensive module-scoped set-up
  and run in order on it, so the set-up is made once and the order kept (tests/reliability/: one
  pipeline per module, each test ends converged for the next one; the modules on a local Redis
  Cluster, `redis_cluster_fixture`: six redis-servers each, and a failover or a slot move slows
  down when two clusters share the two cores with everything else);
- every other test is a unit of its own.

Units go out largest first (the engines at once, to the first worker), then one at a time to
whichever worker runs dry (xdist's `LoadScopeScheduling`, with this split).

Why not `--dist loadgroup` and `xdist_group` marks: with pytest 9.2 and pytest-xdist 3.8 the marks
are silently ignored (xdist writes the group into `item._nodeid`, which pytest 9.2's structured
node ids no longer read: pytest-dev/pytest-xdist#1386), and the tests are spread as if unmarked.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

ENGINES = "tests/engines/"
SGLANG = "tests/engines/test_sglang_real.py"
WHOLE_MODULES = (
    "tests/reliability/", "tests/test_deploy_monitoring.py",
    # redis_cluster_fixture()
    "tests/test_index.py", "tests/test_redis_cluster_harness.py",
    "tests/test_redis_cluster_index.py", "tests/test_writer_lease.py",
)


def work_unit(nodeid: str) -> str:
    """The unit a test belongs to: the engines, its whole module, or the test alone."""
    module = nodeid.split("::", 1)[0]
    if module == SGLANG:
        return module
    if nodeid.startswith(ENGINES):
        return ENGINES
    if module.startswith(WHOLE_MODULES):
        return module
    return nodeid


class SuiteScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)
